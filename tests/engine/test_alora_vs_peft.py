"""Activated LoRA (aLoRA) in the one batch, teacher-forced against PEFT (float32, CPU).

An aLoRA row's positions before the last invocation in its prompt are the base model's and
the rest (the invocation, later prompt tokens, every generated token) the adapter's: a run
boundary inside the row. Its rows run beside base rows and plain LoRA rows, with the
invocation once, twice (the last counts) and not at all (then exactly the base model's
numbers), in prompt chunks that split at the boundary, in speculative verify rows, on the
CPU kernel, the torch GEMMs and the Triton kernels (interpreter). The reference passes PEFT
the offsets of the prompt (``alora_offsets``), as PEFT's ``generate`` computes them.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.greedy_reference import TIE_TOL
from support.lora_fixtures import ALL_MODULES, make_peft_adapter, peft_reference
from support.tiny_models import make_tiny_model

from loramux.adapters.alora import activation_start
from loramux.engine import LLM, LoRARequest, SamplingParams

INV = [500, 501, 502]
INV2 = [600, 601]
INV1 = [500]  # a one-token invocation
MAX_TOKENS = 6
CTX = list(range(300, 340))  # 40 tokens of shared context


def alora_prompts() -> dict[str, list[int]]:
    """Prompts with the invocation in several places (``INV``)."""
    return {
        "end": CTX + INV,  # the usual shape: the invocation closes the prompt
        "once": CTX[:21] + INV + [700, 701, 702, 703, 704],  # the start inside a prompt chunk
        "twice": CTX[:9] + INV + [710, 711, 712, 713] + CTX[9:30] + INV + [720, 721],
        "none": CTX[:30] + [730, 731, 732],
        "partial": CTX[:25] + INV[:2] + [740, 741],  # a prefix of it only: none
    }


def peft_gaps(model, prompt: list[int], output: list[int], invocation: list[int] | None):
    """(gaps, log-softmax rows) of ``output`` under PEFT teacher-forced over prompt + output,
    with the aLoRA offsets PEFT's ``generate`` takes from the prompt."""
    ids = prompt + output
    kwargs = {}
    if invocation is not None:
        start = activation_start(prompt, invocation)
        kwargs["alora_offsets"] = [None if start is None else len(ids) - start]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **kwargs).logits[0].float()
    n = len(prompt)
    rows = logits[n - 1 : n - 1 + len(output)]
    chosen = rows.gather(1, torch.tensor(output)[:, None]).squeeze(1)
    return (rows.max(1).values - chosen).tolist(), torch.log_softmax(rows, -1)


def check_outputs(outs, cases, refs) -> None:
    """Each output (prompt, adapter path or None, invocation or None) is PEFT's, token by
    token within ``TIE_TOL`` and every returned logprob within 1e-4."""
    for out, (prompt, adapter, invocation) in zip(outs, cases, strict=True):
        if adapter not in refs:
            refs[adapter] = peft_reference(*adapter) if adapter is not None else None
        model = refs[adapter] if adapter is not None else refs["base"]
        comp = out.outputs[0]
        gaps, ref_lp = peft_gaps(model, prompt, list(comp.token_ids), invocation)
        assert max(gaps) <= TIE_TOL, (adapter, gaps)
        for j, entry in enumerate(comp.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref_lp[j, tid].item(), abs=1e-4, rel=1e-4), (adapter, j)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, default_model_dir):
    """A tiny Llama, an aLoRA on every projection, a second aLoRA, a plain LoRA."""
    root = tmp_path_factory.mktemp("alora")
    base = make_tiny_model(root / "llama", default_model_dir, "llama")
    return base, {
        "alora": make_peft_adapter(base, root / "alora", r=8, target_modules=ALL_MODULES, std=0.1,
                                   alora_invocation_tokens=INV),
        "alora2": make_peft_adapter(base, root / "alora2", r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                    std=0.15, seed=1, alora_invocation_tokens=INV2),
        "lora": make_peft_adapter(base, root / "lora", r=4, target_modules=ALL_MODULES, std=0.1, seed=2),
        "alora1": make_peft_adapter(base, root / "alora1", r=4, target_modules=ALL_MODULES, std=0.2,
                                    seed=3, alora_invocation_tokens=INV1),
    }


def _engine(base, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
               max_loras=4, max_lora_rank=8, **kw)


def _mixed_cases(base, adapters):
    """Rows of every kind: aLoRA prompts of each shape, a base row, a plain LoRA row."""
    p = alora_prompts()
    a, a2, lora = adapters["alora"], adapters["alora2"], adapters["lora"]
    rows = [(p[k], "alora") for k in p] + [(p["once"], None), (p["twice"], "lora"),
                                          (CTX[:12] + INV2 + [750], "alora2"), (p["end"], "alora2")]
    cases, loras = [], []
    for prompt, name in rows:
        path = {"alora": a, "alora2": a2, "lora": lora}.get(name)
        inv = {"alora": INV, "alora2": INV2}.get(name)
        cases.append((prompt, (base, path) if path is not None else None, inv))
        loras.append(LoRARequest(name, 1 + list(adapters).index(name), str(path)) if name else None)
    return cases, loras


def _backend(name, monkeypatch) -> dict:
    if name == "gemm":  # the torch GEMMs without the C kernel
        from loramux.engine.lora.ops import cpu_sgmv, cpu_step

        monkeypatch.setattr(cpu_step.SgmvStep, "usable", staticmethod(lambda meta: False))
        monkeypatch.setattr(cpu_sgmv, "usable", lambda *a: False)
    return {"lora_backend": "triton"} if name == "triton" else {}


@pytest.mark.parametrize("backend", ["sgmv", "gemm", "triton"])
def test_alora_rows_beside_base_and_lora_rows_match_peft(llama, backend, monkeypatch):
    """One batch: aLoRA rows (invocation at the end, inside, twice, partial, none), a base
    row, a plain LoRA row, a second aLoRA; prompt chunks of 32 tokens split the rows at their
    starts (the ``once`` prompt's start, 21, sits inside its first chunk)."""
    base, adapters = llama
    llm = _engine(base, **_backend(backend, monkeypatch))
    cases, loras = _mixed_cases(base, adapters)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": c[0]} for c in cases], params, lora_request=loras)
    refs = {"base": peft_reference(base, None)}
    check_outputs(outs, cases, refs)


def test_no_invocation_is_exactly_the_base_model(llama):
    """An aLoRA prompt without its invocation is the base model's, bit for bit (even when the
    model writes the invocation itself: generated tokens never activate it)."""
    base, adapters = llama
    llm = _engine(base, max_num_batched_tokens=64)
    prompt = alora_prompts()["none"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    out_a, out_b = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=[
        LoRARequest("alora", 1, str(adapters["alora"])), None])
    assert out_a.outputs[0].token_ids == out_b.outputs[0].token_ids
    assert out_a.outputs[0].logprobs == out_b.outputs[0].logprobs
    assert out_a.prompt_logprobs == out_b.prompt_logprobs


def test_generated_invocation_does_not_activate(llama):
    """The model made to write a one-token invocation (``allowed_token_ids``): its outputs
    stay the base model's, as PEFT's ``generate`` (offsets from the prompt only)."""
    base, adapters = llama
    llm = _engine(base)
    prompt = alora_prompts()["none"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3,
                            allowed_token_ids=[INV1[0], 7])
    out_a, out_b = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=[
        LoRARequest("alora1", 4, str(adapters["alora1"])), None])
    assert INV1[0] in out_a.outputs[0].token_ids
    assert out_a.outputs[0].token_ids == out_b.outputs[0].token_ids
    assert out_a.outputs[0].logprobs == out_b.outputs[0].logprobs
    # once in the prompt, the same request is the adapter's
    out_c, out_d = llm.generate([{"prompt_token_ids": prompt + INV1}] * 2, params, lora_request=[
        LoRARequest("alora1", 4, str(adapters["alora1"])), None])
    assert out_c.outputs[0].logprobs != out_d.outputs[0].logprobs


def _plain(src, dest):
    """The same A and B as a plain LoRA (the invocation field dropped)."""
    shutil.copytree(src, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    del cfg["alora_invocation_tokens"]
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def test_served_as_plain_lora_it_differs(llama, tmp_path):
    """The same weights as a plain LoRA give other numbers (the test can tell the two apart)."""
    base, adapters = llama
    plain = _plain(adapters["alora"], tmp_path / "plain")
    llm = _engine(base, max_num_batched_tokens=64)
    prompt = alora_prompts()["once"]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out_a, out_p = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=[
        LoRARequest("alora", 1, str(adapters["alora"])), LoRARequest("plain", 2, str(plain))])

    def lps(out):
        return torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])

    got_a, got_p = lps(out_a), lps(out_p)
    start = activation_start(prompt, INV)
    # before the start the aLoRA row is the base's (the plain LoRA is not), from it on both adapt
    assert (got_a[: start - 1] - got_p[: start - 1]).abs().max() > 1e-2
    ids = torch.tensor(prompt)
    for model_args, got, kw in (((base, adapters["alora"]), got_a, {"alora_offsets": [len(prompt) - start]}),
                                ((base, plain), got_p, {})):
        with torch.no_grad():
            logits = peft_reference(*model_args)(ids[None], **kw).logits[0].float()
        want = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None]).squeeze(1)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_speculative_verify_rows_match_peft(llama):
    """ngram drafts over a repetitive aLoRA prompt: verify rows (all after the start) and a
    base row beside them, teacher-forced against PEFT."""
    base, adapters = llama
    llm = _engine(base, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    prompt = (CTX[:8] * 3) + INV + CTX[:8]
    cases = [(prompt, (base, adapters["alora"]), INV), (prompt, None, None)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=[
        LoRARequest("alora", 1, str(adapters["alora"])), None])
    check_outputs(outs, cases, {"base": peft_reference(base, None)})


FAMILIES = {  # family: (model overrides, aLoRA target modules)
    "qwen3": ({}, ALL_MODULES),
    "gemma3": (dict(num_hidden_layers=3, sliding_window=10, sliding_window_pattern=3), ALL_MODULES),
    "gemma2": (dict(num_hidden_layers=2), ["q_proj", "v_proj", "down_proj"]),
    "phi3": ({}, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    "qwen3_moe": (dict(num_hidden_layers=2), ["q_proj", "k_proj", "v_proj", "o_proj"]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_alora_matches_peft(family, tmp_path, default_model_dir):
    """Each family's tiny model: aLoRA rows (end, once, twice, none) beside a base row."""
    overrides, targets = FAMILIES[family]
    base = make_tiny_model(tmp_path / family, default_model_dir, family, **overrides)
    adapter = make_peft_adapter(base, tmp_path / "a", r=8, target_modules=targets, std=0.1,
                                alora_invocation_tokens=INV)
    llm = _engine(base)
    p = alora_prompts()
    prompts = [p["end"], p["once"], p["twice"], p["none"], p["once"]]
    cases = [(x, (base, adapter), INV) for x in prompts[:4]] + [(prompts[4], None, None)]
    loras = [LoRARequest("a", 1, str(adapter))] * 4 + [None]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": x} for x in prompts], params, lora_request=loras)
    check_outputs(outs, cases, {"base": peft_reference(base, None)})
