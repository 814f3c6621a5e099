"""The model registry: a Hugging Face ``architectures`` entry → its family's row
(``adapters.families``: one :class:`~loramux.adapters.families.ModelFamily` per family) → the
engine module the row names, whose ``decoder_spec(config)`` turns the config into the
decoder's spec. Adding a family is a row and a module (``docs/architecture.md``, "Adding a
family"); nothing here changes.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from loramux.adapters.arch import resolve_architecture
from loramux.adapters.families import family_of
from loramux.engine.errors import ModelLoadError
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.model.spec import DecoderSpec
from loramux.engine.model.weights import read_hf_config, text_config


def decoder_spec(config) -> DecoderSpec:
    """The decoder spec of a (whole) transformers config, built by the module its
    architecture's family names. Raises :class:`ModelLoadError` when that module cannot be
    imported or has no ``decoder_spec``."""
    family = family_of(resolve_architecture(config))
    try:
        build = importlib.import_module(family.module).decoder_spec
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"family {family.name!r}: its module {family.module!r} does not "
                             f"give a decoder_spec ({e})") from e
    return build(text_config(config))


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, *, enforce_eager: bool = False,
    quantization: str | None = None, tensor_parallel: tuple[int, int] | None = None,
) -> DecoderModel:
    """Build the base model of the folder ``path`` (config + safetensors; quantized as its
    ``quantization_config`` says, which ``quantization`` must match when given). Raises
    :class:`~loramux.engine.model.weights.ModelLoadError` for an unsupported architecture or
    quantization, naming the supported ones. ``tensor_parallel``: (rank, world) to load only
    that rank's share (``engine/distributed/``). Called once when the engine starts."""
    path = Path(path)
    config = read_hf_config(path)
    return DecoderModel(path, dtype, device, enforce_eager=enforce_eager,
                        spec=decoder_spec(config), hf_config=config, quantization=quantization,
                        tensor_parallel=tensor_parallel)
