"""Helpers to make PEFT LoRA adapters for tests (random, non-zero B)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    target_modules: str | list[str] | tuple[str, ...] | None = ("q_proj", "v_proj"),
    alpha: float | None = None,
    seed: int = 0,
    std: float | None = 0.05,
    **lora_kwargs,
) -> Path:
    """Save a PEFT LoRA adapter of ``base_dir`` to ``out_dir``, made by PEFT itself.

    A and B are random and non-zero: drawn with ``std`` (None keeps PEFT's own
    ``init_lora_weights=False`` values, seeded). Extra ``LoraConfig`` fields
    (``use_rslora``, ``use_dora``, ``layers_to_transform``, ...) pass through.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha if alpha is not None else 2 * r,
        target_modules=(target_modules if target_modules is None or isinstance(target_modules, str)
                        else list(target_modules)),
        init_lora_weights=False,
        lora_dropout=0.0,
        **lora_kwargs,
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, cfg)
    if std is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name or "trainable_tokens_delta" in name:  # trainable tokens: the rows
                    p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)


def peft_reference(base_dir: Path, adapter_dir: Path | None):
    """The transformers base model, wrapped in PEFT with the adapter when given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def teacher_forcing_gaps(model, prompt_ids: list[int], output_ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """For each generated token: max logit - its logit under ``model`` (0 = it was the argmax).
    Also returns the log-softmax rows at the generated positions."""
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    n = len(prompt_ids)
    rows = logits[n - 1 : n - 1 + len(output_ids)]
    chosen = rows.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)
    return (rows.max(dim=1).values - chosen).tolist(), torch.log_softmax(rows, dim=-1)


def make_dora_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int = 4,
    target_modules: str | list[str] | tuple[str, ...] = ("q_proj", "v_proj"),
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.05,
    jitter: float = 0.3,
    **lora_kwargs,
) -> Path:
    """Save a PEFT DoRA adapter (``use_dora=True``) of ``base_dir``, made by PEFT itself: A and
    B random (``std``), each magnitude moved away from its row's ``‖W0 + s·BA‖`` by a factor
    ``1 + jitter * N(0, 1)`` (so the magnitude path changes the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        task_type="CAUSAL_LM", r=r, lora_alpha=alpha if alpha is not None else 2 * r,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        init_lora_weights=False, lora_dropout=0.0, use_dora=True, **lora_kwargs,
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for module in model.modules():
            mags = getattr(module, "lora_magnitude_vector", None)
            if mags is None or "default" not in mags:
                continue
            w = module.base_layer.weight
            ba = module.lora_B["default"].weight @ module.lora_A["default"].weight
            norm = torch.linalg.norm(w + module.scaling["default"] * ba, dim=1)
            mags["default"].weight.copy_(norm * (1 + jitter * torch.randn(norm.shape, generator=g)))
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir)
