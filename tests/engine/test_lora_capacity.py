"""Adapter capacity from memory: the arithmetic (CPU and a simulated GPU budget)."""

from __future__ import annotations

import pytest
import torch

from loramux.adapters.arch import BaseModelDims
from loramux.engine.config import (
    DEFAULT_CPU_LORA_MEMORY,
    GPU_LORA_MEMORY_SHARE,
    MAX_DERIVED_LORAS,
    LoRAConfig,
)
from loramux.engine.lora.capacity import adapter_bytes, plan_capacity, slot_bytes
from loramux.engine.lora.slots import SlotBuffers

# SmolLM2-135M's shapes: 30 layers, hidden 576, MLP 1536, 9 heads / 3 KV heads of 64
SMOL = BaseModelDims("llama", 30, 576, 1536, 9, 3, 64)
TINY = BaseModelDims("llama", 2, 64, 128, 4, 2, 16)


@pytest.mark.parametrize("blockdiag", [False, True])
@pytest.mark.parametrize("rank", [4, 16])
def test_slot_bytes_is_what_the_slot_buffers_allocate(blockdiag, rank):
    buffers = SlotBuffers(TINY, 3, rank, torch.float32, "cpu", blockdiag=blockdiag)
    assert slot_bytes(TINY, rank, 4, blockdiag=blockdiag) * 3 == buffers.num_bytes()


def test_slot_bytes_by_hand_for_smollm2_rank_32_bf16():
    # per layer, A: qkv 3*32*576 + o 32*576 + gate_up 2*32*576 + down 32*1536 = 159,744
    # blockdiag B: qkv 96*960 + o 32*576 + gate_up 64*3072 + down 32*576 = 325,632
    # DoRA's per-row gain (4 bytes unless scale_element_size says): 960 + 576 + 3072 + 576 = 5,184
    assert slot_bytes(SMOL, 32, 2, blockdiag=True) == 30 * ((159_744 + 325_632) * 2 + 5_184 * 4)
    # stacked B (the Triton layout): 960*32 + 576*32 + 3072*32 + 576*32 = 165,888
    assert slot_bytes(SMOL, 32, 2, blockdiag=False) == 30 * ((159_744 + 165_888) * 2 + 5_184 * 4)


def test_adapter_bytes_cost_their_own_rank():
    # r * (in + out) per projection: q 576+576, k 576+192, v 576+192, o 576+576,
    # gate 576+1536, up 576+1536, down 1536+576 = 10,176 per unit of rank and layer
    assert adapter_bytes(SMOL, 8, 2) == 30 * 8 * 10_176 * 2
    assert adapter_bytes(SMOL, 32, 2) == 4 * adapter_bytes(SMOL, 8, 2)
    assert adapter_bytes(SMOL, 8, 2, ("q_proj", "v_proj")) == 30 * 8 * (1_152 + 768) * 2


def test_max_loras_keeps_vllms_meaning():
    cap = plan_capacity(LoRAConfig(max_loras=4, max_lora_rank=32), SMOL, 2, device_type="cpu",
                        blockdiag=True)
    assert (cap.num_slots, cap.max_cpu_loras, cap.derived) == (4, 8, False)
    cap = plan_capacity(LoRAConfig(max_loras=4, max_cpu_loras=16), SMOL, 2, device_type="cuda",
                        blockdiag=False)
    assert (cap.num_slots, cap.max_cpu_loras) == (4, 16)


def test_cpu_capacity_is_the_memory_over_slot_plus_cpu_copy():
    per = slot_bytes(SMOL, 32, 2, blockdiag=True) + adapter_bytes(SMOL, 32, 2)
    cap = plan_capacity(LoRAConfig(max_lora_rank=32), SMOL, 2, device_type="cpu", blockdiag=True)
    assert cap.derived and cap.budget_bytes == DEFAULT_CPU_LORA_MEMORY
    assert cap.num_slots == DEFAULT_CPU_LORA_MEMORY // per
    assert cap.num_slots >= 32  # the 32 rank-32 adapters all get a slot by default
    assert cap.max_cpu_loras == cap.num_slots  # every adapter of the CPU tier has a slot
    # an explicit budget, and a CPU tier smaller than what it holds
    cap = plan_capacity(LoRAConfig(max_lora_rank=32, lora_memory=10 * per + per // 2), SMOL, 2,
                        device_type="cpu", blockdiag=True)
    assert (cap.num_slots, cap.max_cpu_loras) == (10, 10)
    cap = plan_capacity(LoRAConfig(max_lora_rank=32, max_cpu_loras=16), SMOL, 2,
                        device_type="cpu", blockdiag=True)
    assert (cap.num_slots, cap.max_cpu_loras) == (16, 16)
    # a tiny model's slots are tiny: capped
    cap = plan_capacity(LoRAConfig(), TINY, 4, device_type="cpu", blockdiag=True)
    assert cap.num_slots == MAX_DERIVED_LORAS


def test_simulated_gpu_budget_splits_with_the_kv_cache():
    per = slot_bytes(SMOL, 64, 2, blockdiag=False)
    free = 40 << 30  # after the weights, at gpu_memory_utilization
    cap = plan_capacity(LoRAConfig(max_lora_rank=64), SMOL, 2, device_type="cuda", blockdiag=False,
                        device_free_bytes=free)
    assert cap.num_slots == min(int(free * GPU_LORA_MEMORY_SHARE) // per, MAX_DERIVED_LORAS)
    assert cap.num_slots * per <= free * GPU_LORA_MEMORY_SHARE  # the KV cache keeps >= 90%
    small = plan_capacity(LoRAConfig(max_lora_rank=64), SMOL, 2, device_type="cuda",
                          blockdiag=False, device_free_bytes=2 << 30)
    assert small.num_slots == int((2 << 30) * GPU_LORA_MEMORY_SHARE) // per
    assert small.max_cpu_loras == 2 * small.num_slots
    fixed = plan_capacity(LoRAConfig(max_lora_rank=64, lora_memory=5 * per), SMOL, 2,
                          device_type="cuda", blockdiag=False, device_free_bytes=free)
    assert fixed.num_slots == 5 and fixed.budget_bytes == 5 * per
    with pytest.raises(ValueError, match="free device memory"):
        plan_capacity(LoRAConfig(), SMOL, 2, device_type="cuda", blockdiag=False)


def test_a_budget_without_room_for_one_slot_is_a_clear_error():
    with pytest.raises(ValueError, match="holds no adapter slot"):
        plan_capacity(LoRAConfig(lora_memory=1000), SMOL, 2, device_type="cpu", blockdiag=True)
    with pytest.raises(ValueError, match="lora_memory"):
        LoRAConfig(lora_memory=0)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)


def test_engine_without_max_loras_gives_every_cpu_tier_adapter_a_slot(tiny_model_dir):
    from loramux.engine import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, enable_lora=True,
              max_lora_rank=8, max_cpu_loras=40)
    manager = llm.llm_engine.lora_manager
    assert manager.max_loras == 40 and manager.max_cpu_loras == 40
    assert manager.buffers.max_loras == 40
    assert llm.llm_engine.scheduler.adapters.max_loras == 40
    snap = manager.snapshot()
    assert snap.max_loras == 40 and snap.max_cpu_loras == 40


def test_cpu_tier_keeps_the_model_dtype_and_is_counted_so(tiny_model_dir):
    """Slots run in the projections' matmul dtype (fp32 for bf16 on AVX2-only CPUs); the CPU
    tier keeps bf16 copies and the capacity counts them at 2 bytes."""
    from loramux.engine import LLM
    from loramux.engine.model.linear import matmul_dtype

    llm = LLM(str(tiny_model_dir), dtype="bfloat16", max_model_len=64, enable_lora=True,
              max_lora_rank=8, max_loras=2)
    manager = llm.llm_engine.lora_manager
    slot_dtype = matmul_dtype(torch.bfloat16, torch.device("cpu"))
    assert manager.buffers.a[0]["qkv"].dtype == slot_dtype
    assert manager.tiers.cpu_dtype == torch.bfloat16
    per = slot_bytes(SMOL, 32, 4, blockdiag=True) + adapter_bytes(SMOL, 32, 2)
    cap = plan_capacity(LoRAConfig(max_lora_rank=32), SMOL, 4, cpu_element_size=2,
                        device_type="cpu", blockdiag=True)
    assert cap.num_slots == DEFAULT_CPU_LORA_MEMORY // per >= 32  # fp32 slots: still 32+
