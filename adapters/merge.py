"""Merge an adapter into its base model for static deployment.

:func:`export_merged` validates the adapter, loads base + adapter with PEFT, calls
``merge_and_unload()`` and saves a standard Hugging Face folder (safetensors weights,
config, generation config, tokenizer). With ``check=True`` (or :func:`check_merged`
afterwards) it reloads the result and compares its logits with PEFT's unmerged
base + adapter on a few prompts. Every family is merged by PEFT; an adapter that names the
base's projections in another spelling (split names on Phi-3's fused checkpoints) is first
rewritten in the base's own names (``fused.py``: the same delta). DoRA adapters merge as PEFT
merges them (``W' = m ⊙ (W0 + s·BA) / ‖W0 + s·BA‖``, the bias untouched).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.adapters.added_tokens import with_adapter_tokens
from loramux.adapters.arch import MODULE_PARENT, base_dims
from loramux.adapters.archive import CONFIG_NAME, WEIGHTS_NAME, adapter_folder
from loramux.adapters.errors import AdapterValidationError
from loramux.adapters.format import LoraWeights, load_adapter, validate_adapter
from loramux.adapters.fused import needs_rewrite, write_native
from loramux.adapters.spec import DEFAULT_MAX_LORA_RANK

logger = logging.getLogger(__name__)

DEFAULT_CHECK_PROMPTS = (
    "How many employees are there?",
    "List all customers from Germany.",
    "Write a haiku about the sea.",
)


class MergeCheckError(RuntimeError):
    """The merged model's logits differ from base + adapter by more than the tolerance."""


@dataclass(frozen=True)
class MergeCheck:
    """Largest absolute logit difference per prompt between the merged model and PEFT."""

    per_prompt: tuple[float, ...]
    atol: float

    @property
    def max_abs_diff(self) -> float:
        return max(self.per_prompt, default=0.0)

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.atol


def _read_base_config(base_model: Path) -> dict:
    path = base_model / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{base_model}: not a Hugging Face model folder (no config.json)")
    return json.loads(path.read_text())


def _copy_adapter(src: Path, dest: Path) -> Path:
    """Copy only the two adapter files, so PEFT never sees anything else."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        shutil.copyfile(src / name, dest / name)
    return dest


def _base_row_norms(base_model: Path, prefix: str):
    """``row_norms(layer, module)``: the norms of a base weight's rows [out], read from the
    base folder's safetensors (one tensor at a time)."""
    from safetensors import safe_open

    index = base_model / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.is_file() else None)

    def row_norms(layer: int, module: str) -> torch.Tensor:
        name = f"{prefix}layers.{layer}.{MODULE_PARENT[module]}.{module}.weight"
        file = base_model / (where[name] if where is not None else "model.safetensors")
        with safe_open(str(file), "pt") as f:
            return torch.linalg.vector_norm(f.get_tensor(name), dim=1, dtype=torch.float32)

    return row_norms


def _peft_adapter(src: Path, base_config: dict, dest: Path, weights: LoraWeights | None = None,
                  base_model: Path | None = None) -> Path:
    """The adapter as PEFT can load it onto the base: its two files, or rewritten in the
    base family's module names (a DoRA adapter's left-out slices read ``base_model``'s row
    norms)."""
    dims = base_dims(base_config)
    if weights is None:
        weights = load_adapter(src, family=dims)
    if needs_rewrite(weights, dims):
        norms = _base_row_norms(base_model, weights.prefix) if base_model is not None else None
        return write_native(weights, dims, dest, norms)
    return _copy_adapter(src, dest)


def _refuse_unmergeable(weights: LoraWeights, base_config: dict) -> None:
    """Refuse, naming the field, what one merged weight cannot express: an aLoRA (it applies
    only from its invocation on), and an embed_tokens / lm_head LoRA on a base that ties the two
    (the merged weight is the one both read; with ``ensure_weight_tying`` it takes both deltas)."""
    from loramux.adapters.arch import text_config

    if weights.spec.alora_invocation_tokens is not None:
        raise AdapterValidationError(
            "alora_invocation_tokens: an activated LoRA (aLoRA) cannot be merged into the base "
            "weights: it applies only from its invocation on, which one merged weight cannot "
            "express (PEFT refuses merge_and_unload too); serve it as an adapter instead",
            field="alora_invocation_tokens")
    if weights.vocab_lora and text_config(base_config).get("tie_word_embeddings"):
        raise AdapterValidationError(
            "target_modules: a LoRA on embed_tokens / lm_head cannot be merged into a base model that "
            "ties its embeddings (one weight serves both; PEFT's merge_and_unload changes both); "
            "serve it as an adapter instead", field="target_modules")


def _load_base(base_model: Path, dtype: torch.dtype):
    """The base model, dense: a quantized (compressed-tensors) checkpoint is dequantized as it
    loads and saves as a plain float model (an adapter merges into the dequantized weights)."""
    from transformers import AutoModelForCausalLM

    quant = _read_base_config(base_model).get("quantization_config")
    if not quant:
        return AutoModelForCausalLM.from_pretrained(base_model, dtype=dtype)
    if quant.get("quant_method") != "compressed-tensors":
        raise AdapterValidationError(
            f"base model: quantization_config.quant_method {quant.get('quant_method')!r} cannot be "
            "merged into (supported: compressed-tensors)", field="base_model")
    from transformers import CompressedTensorsConfig

    base = AutoModelForCausalLM.from_pretrained(
        base_model, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True))
    if hasattr(base.config, "quantization_config"):
        del base.config.quantization_config
    base.hf_quantizer = None
    logger.warning("%s is quantized (compressed-tensors): the adapter merges into its dequantized "
                   "weights and the export is a %s checkpoint, not a quantized one", base_model,
                   str(dtype).replace("torch.", ""))
    return base


EXPORT_METADATA = "loramux_export.json"
"""What an export folder says about itself (beside ``config.json``)."""


def _write_export_metadata(folder: Path, base_config: dict, weights: LoraWeights, dtype: torch.dtype) -> None:
    """``EXPORT_METADATA`` in ``folder``: the adapter's kind, the dtype, and for a quantized base
    its format and that the adapter was merged into its dequantized weights (the export is a
    float checkpoint, not a quantized one)."""
    quant = base_config.get("quantization_config")
    meta = {
        "merged_by": "loramux merge_and_unload",
        "adapter_kind": weights.spec.kind,
        "dtype": str(dtype).replace("torch.", ""),
        "base_quantization": None if not quant else {
            "quant_method": quant.get("quant_method"),
            "merged_into": "dequantized weights",
            "note": "the base was quantized; this export is a float checkpoint of the dequantized "
                    "base with the adapter merged, not a quantized one",
        },
    }
    (folder / EXPORT_METADATA).write_text(json.dumps(meta, indent=2) + "\n")


def _load_peft(base_model: Path, adapter_dir: Path, dtype: torch.dtype):
    from peft import PeftModel

    base = _load_base(base_model, dtype)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    model.eval()
    return model


def _prompt_ids(tokenizer, prompt: str) -> torch.Tensor:
    # Plain text, no chat template: the LoRA delta applies to every token either way, and
    # short inputs keep float32 rounding (~5e-5 on the default model) under the tolerance.
    # (Through the default model's long built-in system prompt, PEFT's own float32 logits
    # drift 2.6e-4 from a float64 computation, so the comparison would measure that.)
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


@torch.no_grad()
def _compare(reference, merged, tokenizer, prompts: Sequence[str], atol: float) -> MergeCheck:
    diffs = []
    for prompt in prompts:
        ids = _prompt_ids(tokenizer, prompt)
        want = reference(input_ids=ids).logits.float()
        got = merged(input_ids=ids).logits.float()
        diffs.append(float((want - got).abs().max()))
    return MergeCheck(tuple(diffs), atol)


def check_merged(
    base_model: str | os.PathLike,
    adapter: str | os.PathLike,
    merged: str | os.PathLike,
    *,
    prompts: Sequence[str] = DEFAULT_CHECK_PROMPTS,
    atol: float = 1e-4,
    dtype: torch.dtype = torch.float32,
) -> MergeCheck:
    """Compare the logits of the merged folder with PEFT's unmerged base + adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model, merged = Path(base_model), Path(merged)
    with adapter_folder(adapter) as folder, tempfile.TemporaryDirectory() as tmp:
        adapter_dir = _peft_adapter(folder, _read_base_config(base_model), Path(tmp),
                                    base_model=base_model)
        reference = _load_peft(base_model, adapter_dir, dtype)
    merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(
        merged if (merged / "tokenizer_config.json").exists() else base_model
    )
    return _compare(reference, merged_model, tokenizer, prompts, atol)


def export_merged(
    base_model: str | os.PathLike,
    adapter: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    check: bool = False,
    prompts: Sequence[str] = DEFAULT_CHECK_PROMPTS,
    atol: float = 1e-4,
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Merge ``adapter`` into ``base_model`` and save a Hugging Face folder at ``out``.

    The folder is written beside ``out`` and renamed into place when complete. With
    ``check=True`` the saved folder is reloaded and its logits compared with PEFT's
    base + adapter on ``prompts``; a difference above ``atol`` raises
    :class:`MergeCheckError` (the folder is kept for inspection). An activated LoRA
    (``alora_invocation_tokens``) cannot be merged: :class:`AdapterValidationError` naming it.
    Called by ``loramux export`` and the registry's export.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_model, out = Path(base_model), Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True to replace it)")
    base_config = _read_base_config(base_model)
    weights = validate_adapter(adapter, base_config, max_lora_rank=max_lora_rank, base_folder=base_model)
    _refuse_unmergeable(weights, base_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    steps = ["load base + adapter", "merge", "save", *(["check"] if check else [])]
    with (
        tqdm(total=len(steps), desc="export", unit="step", disable=not progress) as bar,
        adapter_folder(adapter) as folder,
        tempfile.TemporaryDirectory() as tmp_adapter,
    ):
        bar.set_postfix_str(steps[0])
        adapter_dir = _peft_adapter(folder, base_config, Path(tmp_adapter), weights, base_model)
        model = _load_peft(base_model, adapter_dir, dtype)
        bar.update()
        bar.set_postfix_str(steps[1])
        merged = model.merge_and_unload(progressbar=progress)
        bar.update()
        bar.set_postfix_str(steps[2])
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            merged.save_pretrained(staging, safe_serialization=True)
            _write_export_metadata(staging, base_config, weights, dtype)
            try:
                with_adapter_tokens(AutoTokenizer.from_pretrained(base_model), folder
                                    ).save_pretrained(staging)  # the adapter's own tokens too
            except (OSError, ValueError) as e:
                logger.warning("no tokenizer copied from %s: %s", base_model, e)
            if out.exists():
                shutil.rmtree(out)
            staging.rename(out)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        bar.update()
        del merged
        if check:
            bar.set_postfix_str(steps[3])
            reference = _load_peft(base_model, adapter_dir, dtype)
            merged_model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
            tokenizer = AutoTokenizer.from_pretrained(
                out if (out / "tokenizer_config.json").exists() else base_model
            )
            result = _compare(reference, merged_model, tokenizer, prompts, atol)
            bar.update()
            if not result.ok:
                raise MergeCheckError(
                    f"merged logits differ from base + adapter by {result.max_abs_diff:.3g} "
                    f"(tolerance {atol:g}); the folder is kept at {out}"
                )
            logger.info("merge check passed: max |Δlogit| = %.3g", result.max_abs_diff)
    return out
