"""What an engine loads at start: the model folder, its device and dtype, the tokenizer and
the end-of-sequence ids (``LLMEngine.__init__`` calls :func:`load_base`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from loramux.engine.config import ModelConfig, ParallelConfig
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.model.registry import load_model


@dataclass
class LoadedBase:
    """The base model an engine serves and what reads its tokens."""

    path: Path
    device: torch.device
    dtype: torch.dtype
    model: DecoderModel
    tokenizer: Any
    eos_token_ids: set[int]

    def max_model_len(self, requested: int | None) -> int:
        """``--max-model-len`` (None: the model's ``max_position_embeddings``), checked."""
        most = self.model.dims.max_position_embeddings
        if requested is not None and requested > most:
            raise ValueError(f"max_model_len {requested} exceeds the model's "
                             f"max_position_embeddings {most}")
        return requested or most


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cpu_has_fast_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device, model_path: Path) -> torch.dtype:
    """``auto``: the checkpoint's dtype, except bfloat16 where it is much faster (CUDA, and
    CPUs with native bf16 matmuls, as vLLM's CPU backend does) and never float16 on a CPU."""
    if name == "auto":
        from transformers import AutoConfig

        cfg_dtype = getattr(AutoConfig.from_pretrained(model_path), "dtype", None)
        name = str(cfg_dtype).replace("torch.", "") if cfg_dtype is not None else "float32"
        if device.type == "cpu" and (
            name == "float16" or (name == "float32" and _cpu_has_fast_bf16())
        ):
            name = "bfloat16"
        if device.type == "cuda" and name == "float32":
            name = "bfloat16"
    dtype = getattr(torch, name)
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 is not supported on the CPU (it is very slow there); use bfloat16 or float32")
    return dtype


def model_folder(name: str | None) -> Path:
    """The local folder of ``--model`` (None: the default model, converted once)."""
    if name is None:
        from loramux.engine.default_model import default_model_path

        return default_model_path()
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(f"model {name!r} is not a local folder")
    return path


def eos_token_ids(tokenizer, model_path: Path) -> set[int]:
    """The tokenizer's EOS id and those of the folder's ``generation_config.json``."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_cfg = model_path / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def load_base(mc: ModelConfig, parallel: ParallelConfig | None = None) -> LoadedBase:
    """Load the base model and tokenizer of ``mc``; under tensor parallelism (``parallel``)
    this process is rank 0 and loads rank 0's share (on the CPU with its share of the cores)."""
    from transformers import AutoTokenizer

    from loramux.engine.distributed.group import cpu_threads

    path = model_folder(mc.model)
    device = resolve_device(mc.device)
    dtype = resolve_dtype(mc.dtype, device, path)
    world = parallel.tensor_parallel_size if parallel is not None else 1
    if world > 1 and device.type == "cpu":
        torch.set_num_threads(cpu_threads(world))
    model = load_model(path, dtype, device, enforce_eager=mc.enforce_eager,
                       quantization=mc.quantization, tensor_parallel=(0, world) if world > 1 else None)
    tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer or path)
    return LoadedBase(path, device, dtype, model, tokenizer, eos_token_ids(tokenizer, path))
