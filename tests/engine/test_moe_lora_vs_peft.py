"""LoRA on the experts (PEFT ``target_parameters`` on ``mlp.experts.gate_up_proj`` /
``down_proj``) of tiny Qwen3-MoE and Mixtral bases, in one mixed batch with attention-only
adapters and base rows, every token teacher-forced against PEFT (float32, CPU): ranks 4..32,
one parameter or both, the router (``mlp.gate.weight``, as PEFT's ``all-linear`` targets it), PEFT's own mapping of ``gate_proj`` / ``up_proj`` / ``down_proj`` onto
the experts (gate_up at twice the rank), rsLoRA; chunked prefill (a small token budget) and a
prefix-cache hit; validation refusing another expert count or layout with the parameter and
the expected shape; slot memory and capacity counting the experts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.lora_fixtures import make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
BASES = {  # name: (family, overrides, [(rank, target_modules, target_parameters, extra)])
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), [
        (8, ["q_proj", "v_proj"], EXPERTS, {}),
        (4, ["k_proj", "v_proj"], None, {}),
        (16, ["o_proj"], ["mlp.experts.down_proj"], {"use_rslora": True}),
        (4, ["q_proj", "gate_proj", "up_proj", "down_proj"], None, {}),  # PEFT maps these onto the experts
        (8, "all-linear", None, {}),  # attention, the experts (gate_up at rank 16) and the router
    ]),
    "mixtral": ("mixtral", {}, [
        (32, ["q_proj"], EXPERTS, {}),
        (8, ["v_proj", "o_proj"], None, {}),
        (4, None, ["mlp.experts.gate_up_proj"], {}),
        (4, ["k_proj"], ["mlp.gate.weight"], {}),  # the router alone
    ]),
}


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 50)  # a long prompt: several prefill chunks


def _adapters(base, tmp_path, specs):
    out = []
    for i, (r, modules, params, extra) in enumerate(specs):
        kw = dict(extra)
        if params is not None:
            kw["target_parameters"] = params
        out.append(make_peft_adapter(base, tmp_path / f"a{i}", r=r, target_modules=modules, seed=i,
                                     std=0.3, **kw))
    return out


def _check_rows(base, adapters, rows, choice, outs):
    return set(check_rows_match_peft(base, adapters, rows, choice, outs))


@pytest.mark.parametrize("name", list(BASES))
def test_expert_adapters_mixed_with_dense_ones_and_base_rows_match_peft(name, tmp_path, default_model_dir,
                                                                         prompts):
    family, overrides, specs = BASES[name]
    base = make_tiny_model(tmp_path / name, default_model_dir, family, **overrides)
    adapters = _adapters(base, tmp_path, specs)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=32, max_num_batched_tokens=40)
    choice = [i % (len(adapters) + 1) for i in range(len(prompts) + 2)]
    choice = [None if c == len(adapters) else c for c in choice]
    rows = (prompts + prompts)[: len(choice)]
    loras = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    assert _check_rows(base, adapters, rows, choice, outs) == set(range(len(adapters))), "every adapter counts"
    # a prefix-cache hit: the second round reuses the first round's blocks of the same adapters
    hits = llm.llm_engine.kv.stats.hits
    again = llm.generate([{"prompt_token_ids": rows[1] + rows[0]}], params, lora_request=[loras[1]])
    assert llm.llm_engine.kv.stats.hits > hits
    _check_rows(base, adapters, [rows[1] + rows[0]], [choice[1]], again)


@pytest.fixture(scope="module")
def qwen_moe(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("val")
    base = make_tiny_model(root / "base", default_model_dir, "qwen3_moe", num_hidden_layers=2)
    adapter = make_peft_adapter(base, root / "ad", r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    return base, adapter


def _config(base, **changes):
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize(("changes", "needle"), [
    (dict(num_experts=16), "mlp.experts.base_layer.lora_A.weight: shape [32, 64], expected [64, 64] "
                           "for mlp.experts.gate_up_proj (16 experts × rank 4"),
    (dict(moe_intermediate_size=16), "lora_B.weight: shape [64, 32], expected [32, 32] for "
                                     "mlp.experts.gate_up_proj"),
])
def test_an_adapter_for_another_expert_layout_is_refused(qwen_moe, changes, needle):
    from loramux.adapters.format import AdapterValidationError, validate_adapter

    base, adapter = qwen_moe
    with pytest.raises(AdapterValidationError) as e:
        validate_adapter(adapter, _config(base, **changes), max_lora_rank=16)
    assert needle in str(e.value)
    assert e.value.field.startswith("base_model.model.model.layers.0.mlp.experts.")


def test_expert_lora_on_a_dense_base_or_unknown_parameters_is_refused(qwen_moe, tmp_path, tiny_model_dir):
    from loramux.adapters.format import AdapterValidationError, validate_adapter

    base, adapter = qwen_moe
    with pytest.raises(AdapterValidationError, match="needs a mixture-of-experts base"):
        validate_adapter(adapter, json.loads((tiny_model_dir / "config.json").read_text()),
                         base_model_name="x")
    router = shutil.copytree(adapter, tmp_path / "router")
    cfg = json.loads((router / "adapter_config.json").read_text())
    cfg["target_parameters"] = ["mlp.gate.weight", *EXPERTS]  # names the router: its tensors are missing
    (router / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match=r"layers\.0\.mlp\.gate\.lora_A\.weight: missing tensor"):
        validate_adapter(router, _config(base), max_lora_rank=16)
    cfg["target_parameters"] = ["mlp.experts.up_proj"]
    (router / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterValidationError, match="'mlp.experts.up_proj' is not an expert parameter"):
        validate_adapter(router, _config(base), max_lora_rank=16)


def test_slots_and_capacity_count_the_experts(qwen_moe):
    from loramux.adapters.format import load_adapter
    from loramux.engine.config import LoRAConfig
    from loramux.engine.lora.capacity import plan_capacity, slot_bytes
    from loramux.engine.lora.slots import SlotBuffers
    from loramux.engine.model.weights import dims_from_config, read_hf_config

    base, adapter = qwen_moe
    dims = dims_from_config(read_hf_config(base))
    e, h, i, r = dims.num_experts, dims.hidden_size, dims.moe_intermediate_size, 8
    expert_part = len(dims.moe_layers) * (e * r * ((h + 2 * i) + (i + h)) + r * (h + e)) * 4  # + the router
    slots = SlotBuffers(dims, 2, r, torch.float32, "cpu", blockdiag=True)
    assert slots.num_bytes() == 2 * slot_bytes(dims, r, 4, blockdiag=True)
    assert slots.experts.num_bytes() == 2 * expert_part
    cap = plan_capacity(LoRAConfig(max_lora_rank=r, lora_memory=10 * 2**20), dims, 4, device_type="cpu",
                        blockdiag=True)
    assert cap.slot_bytes == slot_bytes(dims, r, 4, blockdiag=True) and cap.slot_bytes > expert_part
    weights = load_adapter(adapter)
    slots.write(1, weights)
    a, b = weights.experts[0]["gate_up_proj"]  # [E, 4, H], [E, 2I, 4]
    scale = weights.spec.expert_scale("gate_up_proj")
    assert torch.allclose(slots.experts.a[0]["gate_up_proj"][1, :, :4], a * scale)
    assert torch.equal(slots.experts.b[0]["gate_up_proj"][1, :, :4], b.transpose(1, 2))
    assert torch.count_nonzero(slots.experts.a[0]["gate_up_proj"][1, :, 4:]) == 0
    assert slots.experts.has[1] and not slots.experts.has[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])  # triton: under TRITON_INTERPRET=1 on the CPU
@pytest.mark.parametrize("rows", [24, 300])  # decode-sized and prefill-sized
def test_expert_delta_equals_the_definition(rows, backend):
    """The experts' delta through the engine's LoRA kernel over (slot, expert) virtual slots
    (the CPU SGMV kernel on the block-diagonal layout; the Triton shrink/expand on theirs)
    equals ``scale * B_e @ A_e @ x`` of each row's own adapter and expert, with rows of no
    adapter and of dense-only adapters untouched."""
    from types import SimpleNamespace

    import numpy as np

    from loramux.engine.lora import ops
    from loramux.engine.lora.experts import ExpertSlots, ExpertStep

    if backend == "triton":
        pytest.importorskip("triton")
    blockdiag = backend == "torch"
    g = torch.Generator().manual_seed(0)
    dims = SimpleNamespace(num_experts=6, hidden_size=32, moe_intermediate_size=24, moe_layers=(0, 2))
    slots = ExpertSlots(dims, 4, 8, torch.float32, "cpu", blockdiag=blockdiag)
    ranks = {0: 8, 2: 4, 3: 6}  # slot 1: a dense-only adapter
    a_ref, b_ref = {}, {}  # [E, r, K], [E, N, r] per slot
    for s in range(4):
        a_ref[s] = torch.randn(6, ranks.get(s, 1), 32, generator=g)
        b_ref[s] = torch.randn(6, 48, ranks.get(s, 1), generator=g)
    from loramux.adapters.format import LoraWeights
    from loramux.adapters.spec import LoraSpec

    for s, r in ranks.items():
        spec = LoraSpec(r=r, lora_alpha=float(r), target_modules=(), target_parameters=("gate_up_proj",),
                        parameter_ranks=(("gate_up_proj", r, float(2 * r)),))  # scale 2
        slots.write(s, LoraWeights(spec, {}, experts={2: {"gate_up_proj": (a_ref[s], b_ref[s])}}))
    tokens_n, k = (rows + 1) // 2, 2
    token_slots = np.random.default_rng(0).integers(-1, 4, tokens_n)
    experts = torch.randint(0, 6, (tokens_n * k,), generator=g)
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=6).tolist()
    tokens = order // k
    x = torch.randn(tokens_n * k, 32, generator=g)
    want = torch.zeros(tokens_n * k, 48)
    e_sorted = experts[order]
    for j in range(tokens_n * k):
        s = int(token_slots[tokens[j]])
        if s in ranks:
            e = int(e_sorted[j])
            want[j] = 2 * (b_ref[s][e] @ (a_ref[s][e] @ x[j]))
    assert want.abs().sum() > 0 and (want == 0).all(dim=1).any()
    step = ExpertStep(slots, "cpu", ops.lora_kernel(backend, blockdiag=blockdiag))
    step.prepare(token_slots)
    y = torch.zeros_like(want)
    step.add(2, "gate_up", x, y, tokens, counts)
    assert torch.allclose(y, want, atol=1e-3, rtol=1e-4)


def test_engine_refuses_an_expert_adapter_of_another_base(qwen_moe, tmp_path, default_model_dir):
    """A local adapter (no registry in between) trained for 4 experts on an 8-expert base fails
    its own request with the parameter named; the engine keeps serving."""
    from loramux.engine.errors import LoRAError

    base, _ = qwen_moe
    other = make_tiny_model(tmp_path / "other", default_model_dir, "qwen3_moe", num_hidden_layers=2,
                            num_experts=4)
    adapter = make_peft_adapter(other, tmp_path / "ad4", r=4, target_modules=["q_proj"], target_parameters=EXPERTS)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=1,
              max_lora_rank=16)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(LoRAError, match=r"mlp\.experts\.(gate_up|down)_proj of layer 0 does not fit the base "
                       r"model \(8 experts"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, lora_request=[LoRARequest("x", 1, str(adapter))])
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)[0].outputs[0].token_ids) == 2
