"""The vocabulary parts of adapters (``adapters/vocab.py``, ``engine/lora/vocab.py``) against
PEFT (float32, teacher-forced), in one mixed batch with base rows and a plain LoRA: trainable
tokens (the rows themselves; on a tied base the logits' columns too), ``embed_tokens`` LoRA and
``lm_head`` LoRA, with PEFT's ``ensure_weight_tying`` and without. Each adapter served as a plain
LoRA (its vocabulary parts dropped) gives other numbers, so the check can tell."""

from __future__ import annotations

import json

import pytest
import torch
from support.lora_fixtures import make_peft_adapter, peft_reference, teacher_forcing_gaps
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_llama, make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8


def _specs(prompts):
    """(name, LoraConfig extras) of the adapters: the trainable tokens are ids the prompts hold."""
    ids = sorted({prompts[0][1], prompts[2][0], prompts[3][2], prompts[5][1], 42, 1000})
    return [
        ("tokens", dict(target_modules=["q_proj"], trainable_token_indices=ids)),
        ("tokens-dict", dict(target_modules=["v_proj"], trainable_token_indices={"embed_tokens": [prompts[1][2], 77, prompts[1][0]]})),
        ("embed-head", dict(target_modules=["embed_tokens", "lm_head"])),  # no linear LoRA at all
        ("embed-tied", dict(target_modules=["embed_tokens", "o_proj"], ensure_weight_tying=True)),
        ("plain", dict(target_modules=["q_proj", "v_proj"])),
    ]


def _plain_copy(adapter, out):
    """``adapter`` without its vocabulary parts: what serving it as a plain LoRA would give."""
    from loramux.adapters.format import load_adapter
    from loramux.adapters.weights import save_adapter

    w = load_adapter(adapter)
    w.vocab_lora, w.vocab_tokens = {}, {}
    w.spec = type(w.spec)(**{**w.spec.__dict__, "vocab_modules": (), "trainable_tokens": (),
                             "target_modules": w.spec.target_modules})
    return save_adapter(w, out)


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 20)


@pytest.mark.parametrize("tied", [True, False, "gemma3"], ids=["tied", "untied", "gemma3"])
def test_vocab_parts_in_a_mixed_batch_match_peft(tied, tmp_path, default_model_dir, prompts):
    """Llama tied and untied; Gemma 3 (tied, an embedding scale and a final soft-cap: the
    parts apply before the scale and before the cap, as PEFT's wrappers do)."""
    if tied == "gemma3":
        base = make_tiny_model(tmp_path / "base", default_model_dir, "gemma3", final_logit_softcapping=30.0)
    else:
        base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=tied)
    specs = _specs(prompts)
    adapters = [make_peft_adapter(base, tmp_path / name, r=4 + 4 * i, seed=i, std=0.1, **extra)
                for i, (name, extra) in enumerate(specs)]
    cfg = json.loads((adapters[3] / "adapter_config.json").read_text())
    assert cfg["ensure_weight_tying"] is True
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=32, max_num_batched_tokens=96)
    rows = prompts + prompts[:4]
    choice = [0, 1, 2, 3, 4, None, 3, 2, 1, 0]
    loras = [None if c is None else LoRARequest(specs[c][0], c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    refs: dict = {}
    check_rows_match_peft(base, adapters, rows, choice, outs, refs=refs, against_base=False)
    # served as plain LoRA, each vocabulary adapter would give other numbers: the check tells
    for c in range(4):
        i = choice.index(c)
        plain = peft_reference(base, _plain_copy(adapters[c], tmp_path / f"plain{c}"))
        toks = outs[i].outputs[0].token_ids
        _, want = teacher_forcing_gaps(refs[c], rows[i], toks)
        _, without = teacher_forcing_gaps(plain, rows[i], toks)
        assert (want - without).abs().max() > 1e-2, specs[c][0]


def test_slots_hold_and_count_the_vocabulary_parts(tmp_path, default_model_dir, prompts):
    from loramux.adapters.format import load_adapter
    from loramux.engine.lora.slots import SlotBuffers
    from loramux.engine.model.weights import dims_from_config, read_hf_config

    base = make_tiny_llama(tmp_path / "base", default_model_dir)
    specs = _specs(prompts)
    dims = dims_from_config(read_hf_config(base))
    slots = SlotBuffers(dims, 2, 8, torch.float32, "cpu")
    before = slots.num_bytes()
    tokens = load_adapter(make_peft_adapter(base, tmp_path / "t", seed=1, **specs[0][1]))
    slots.write(0, tokens)
    n = len(specs[0][1]["trainable_token_indices"])
    assert slots.num_bytes() - before == 2 * (n * 64 * 4 + n * 8)  # embed rows + the tied head's
    emb = load_adapter(make_peft_adapter(base, tmp_path / "e", seed=2, **specs[2][1]))
    slots.write(1, emb)
    vocab = dims.vocab_size
    assert slots.num_bytes() - before == 2 * (n * 64 * 4 + n * 8) + 2 * 4 * (vocab * 4 + 4 * 64)
    assert slots.groups[1] == frozenset() and int(slots.ranks[1]) == 4
    slots.clear(0)
    slots.clear(1)
    assert slots.num_bytes() == before
    bad = load_adapter(make_peft_adapter(base, tmp_path / "t", seed=1, **specs[0][1]))
    bad.vocab_tokens["embed_tokens"][0][0] = vocab  # an adapter never validated against this base
    with pytest.raises(ValueError, match=f"token id {vocab} is outside"):
        slots.write(0, bad)
    assert slots.num_bytes() == before and not slots.vocab.has(0)


def test_capacity_from_memory_counts_the_vocabulary_parts(tmp_path, default_model_dir, prompts):
    """Derived from memory on the CPU, an adapter's copy and its vocabulary parts' slot tensors
    must fit what the plan counts for one adapter; past it the load fails, naming why."""
    from loramux.adapters.format import load_adapter
    from loramux.engine.config import LoRAConfig
    from loramux.engine.lora.capacity import adapter_bytes, plan_capacity, slot_bytes
    from loramux.engine.lora.slots import SlotBuffers
    from loramux.engine.model.weights import dims_from_config, read_hf_config

    base = make_tiny_llama(tmp_path / "base", default_model_dir)
    dims = dims_from_config(read_hf_config(base))
    cap = plan_capacity(LoRAConfig(max_lora_rank=8, lora_memory=2**30), dims, 4, device_type="cpu",
                        blockdiag=True)
    assert cap.adapter_allowance == adapter_bytes(dims, 8, 4)
    emb = load_adapter(make_peft_adapter(base, tmp_path / "e", r=8, target_modules=["embed_tokens", "lm_head"]))
    slots = SlotBuffers(dims, 1, 8, torch.float32, "cpu", blockdiag=True)
    need = emb.num_bytes() + slots.vocab.part_bytes(emb)
    assert need == 2 * 2 * 8 * (dims.vocab_size + 64) * 4
    slots.vocab.allowance = need - 1
    with pytest.raises(ValueError, match="adapter memory plan"):
        slots.write(0, emb)
    slots.vocab.allowance = need
    slots.write(0, emb)
    assert slots.vocab.num_bytes() == slots.vocab.part_bytes(emb)
    # on a GPU the resident parts share what the adapter memory holds beyond the slots
    per = slot_bytes(dims, 8, 4, blockdiag=False)
    gpu = plan_capacity(LoRAConfig(max_lora_rank=8, lora_memory=3 * per + 1000), dims, 4,
                        device_type="cuda", blockdiag=False, device_free_bytes=2**34)
    assert (gpu.num_slots, gpu.vocab_pool, gpu.adapter_allowance) == (3, 1000, None)
    slots.vocab.allowance, slots.vocab.pool = None, slots.vocab.part_bytes(emb)
    slots.write(0, emb)  # replaces its own parts: fits
    two = SlotBuffers(dims, 2, 8, torch.float32, "cpu", blockdiag=True)
    two.vocab.pool = slots.vocab.pool
    two.write(0, emb)
    with pytest.raises(ValueError, match="beyond its slots"):
        two.write(1, emb)


def test_head_tokens_and_prompt_logprobs_match_peft(tmp_path, default_model_dir, prompts):
    """On an untied base, trainable tokens listed for ``lm_head`` apart from the embedding's
    change only the logits' columns; prompt logprobs (the logits of every prompt position) are
    PEFT's too."""
    base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=False)
    ids = {"embed_tokens": [prompts[0][1], 11], "lm_head": [prompts[0][3], 42, 1000]}
    a = make_peft_adapter(base, tmp_path / "a", r=4, std=1.0, target_modules=["q_proj"],
                          trainable_token_indices=ids)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True, max_loras=1,
              max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=3)
    out = llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[0]}], params,
                       lora_request=[LoRARequest("t", 1, str(a)), None])
    ref = peft_reference(base, a)
    check_rows_match_peft(base, [a], [prompts[0]] * 2, [0, None], out, refs={0: ref}, against_base=False)
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([prompts[0]])).logits[0].float(), -1)
    for j, entry in enumerate(out[0].prompt_logprobs[1:]):
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(want[j, tid].item(), abs=1e-4), (j, tid)
    # the head's rows (std 1) lead the logits: the check compared them
    assert any(set(e) & set(ids["lm_head"]) for e in out[0].prompt_logprobs[1:])


def test_engine_compares_full_copies_with_its_base(tmp_path, default_model_dir, prompts):
    """An adapter handed to the engine directly (no upload) with PEFT's full copy of the
    embedding that differs from the served checkpoint's: the rows that differ are served as the
    adapter's own (PEFT loads the copy into the base layer) — PEFT's numbers, base rows untouched."""
    from safetensors.torch import load_file, save_file

    base = make_tiny_llama(tmp_path / "base", default_model_dir)
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["embed_tokens", "q_proj"])
    sd = load_file(a / "adapter_model.safetensors")
    sd["base_model.model.model.embed_tokens.base_layer.weight"][prompts[0][1]] += 1
    save_file(sd, str(a / "adapter_model.safetensors"))
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * 2, params,
                        lora_request=[LoRARequest("copy", 1, str(a)), None])
    check_rows_match_peft(base, [a], [prompts[0]] * 2, [0, None], outs, against_base=False)
