"""The model registry: a Hugging Face ``architectures`` entry → its family
(``adapters.arch.ARCHITECTURES``, the one table) → the family's module here, which turns the
config into the decoder's spec.

Adding a family: a row in ``adapters/arch.py`` (``FAMILIES``, ``ARCHITECTURES``: what LoRA may
target, the checkpoint prefixes), a module ``models/<family>.py`` with ``decoder_spec(config)``,
its entry in :data:`FAMILY_MODULES`, and the family's test (copy
``tests/engine/test_families_vs_transformers.py``'s config row).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from loramux.adapters.arch import FAMILIES, resolve_architecture
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.model.spec import DecoderSpec
from loramux.engine.model.weights import read_hf_config, text_config

FAMILY_MODULES = {
    "llama": "loramux.engine.model.models.llama",
    "qwen3": "loramux.engine.model.models.qwen3",
    "gemma3": "loramux.engine.model.models.gemma3",
    "gemma2": "loramux.engine.model.models.gemma2",
    "phi3": "loramux.engine.model.models.phi3",
    "qwen3_moe": "loramux.engine.model.models.qwen3_moe",
    "mixtral": "loramux.engine.model.models.mixtral",
}
"""Family name (``adapters.arch.FAMILIES``) → the module with its ``decoder_spec``."""
assert set(FAMILY_MODULES) == set(FAMILIES), "every family needs its module"


def decoder_spec(config) -> DecoderSpec:
    """The decoder spec of a (whole) transformers config, by its architecture's family."""
    family = resolve_architecture(config).family
    module = importlib.import_module(FAMILY_MODULES[family])
    return module.decoder_spec(text_config(config))


def load_model(
    path: str | Path, dtype: torch.dtype, device: torch.device, *, enforce_eager: bool = False
) -> DecoderModel:
    """Build the base model of the folder ``path`` (config + safetensors). Raises
    :class:`~loramux.engine.model.weights.ModelLoadError` for an unsupported architecture,
    naming the supported ones. Called once when the engine starts."""
    path = Path(path)
    config = read_hf_config(path)
    return DecoderModel(path, dtype, device, enforce_eager=enforce_eager,
                        spec=decoder_spec(config), hf_config=config)
