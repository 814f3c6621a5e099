"""The engine and adapter packages import without the platform's dependencies, and
without an install (the GPU machine runs the benchmarks from the source tree)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What the platform needs and the engine must not pull in at import time (xgrammar is
# imported only when a request carries a grammar).
PLATFORM_ONLY = (
    "fastapi", "starlette", "uvicorn", "sqlalchemy", "alembic", "boto3", "botocore",
    "redis", "pydantic_settings", "xgrammar",
)  # fmt: skip
ENGINE_MODULES = (
    "loramux.engine", "loramux.adapters", "loramux.engine.llm", "loramux.engine.engine",
    "loramux.engine.async_engine", "loramux.engine.model.registry",
    "loramux.engine.model.triton_attention", "loramux.engine.lora.ops",
    "loramux.engine.lora.ops.triton_ops", "loramux.engine.lora.manager",
    "loramux.engine.structured_output", "loramux.adapters.format", "loramux.adapters.merge",
    "loramux.adapters.archive",
)  # fmt: skip

_PROBE = """
import importlib, json, sys
for name in {modules!r}:
    importlib.import_module(name)
from loramux.engine import LLM, AsyncEngine, LLMEngine, SamplingParams
print(json.dumps({{
    "loaded": [m for m in {modules!r} if m in sys.modules],
    "forbidden": sorted({{m.split(".")[0] for m in sys.modules}} & set({forbidden!r})),
    "engine_file": sys.modules["loramux.engine"].__file__,
}}))
"""


def _probe(*python_args: str, env: dict | None = None, prelude: str = "") -> dict:
    code = prelude + _PROBE.format(modules=ENGINE_MODULES, forbidden=PLATFORM_ONLY)
    proc = subprocess.run(
        [sys.executable, *python_args, "-c", code], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_engine_imports_need_no_platform_dependency():
    for name in PLATFORM_ONLY[:3]:  # the probe means something only where they exist
        __import__(name)
    out = _probe()
    assert out["loaded"] == list(ENGINE_MODULES)
    assert out["forbidden"] == [], f"importing the engine pulled in {out['forbidden']}"


def test_engine_imports_from_the_source_tree_without_install():
    """``python -S`` skips site-packages' .pth files, so the editable install is invisible;
    the packages come through ``bench/source_tree.py`` from engine/ and adapters/."""
    paths = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    env = {"PYTHONPATH": ":".join([str(ROOT / "bench"), *sorted(paths)]), "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "1"}  # fmt: skip
    prelude = (
        "import importlib.util, source_tree\n"
        "assert importlib.util.find_spec('loramux') is None, 'loramux is visible without site'\n"
        "assert source_tree.use_source_tree() == 'source'\n"
    )
    out = _probe("-S", env=env, prelude=prelude)
    assert out["loaded"] == list(ENGINE_MODULES)
    assert Path(out["engine_file"]) == ROOT / "engine" / "__init__.py"
    assert out["forbidden"] == []


_GENERATE = """
import json, sys
from transformers import AutoConfig, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

def loaded():
    return {{m.split(".")[0] for m in sys.modules}} & set({forbidden!r})

AutoConfig.from_pretrained({model!r}), AutoTokenizer.from_pretrained({model!r})
third_party = loaded()  # what transformers itself brings (accelerate imports boto3 if present)
from loramux.engine import LLM, SamplingParams
llm = LLM({model!r}, dtype="float32", max_model_len=128, num_gpu_blocks_override=64)
llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3))
plain = sorted(loaded() - third_party)
llm.generate(["Pick:"], SamplingParams(temperature=0, max_tokens=3, structured_outputs={{"choice": ["yes", "no"]}}))
print(json.dumps({{"plain": plain, "with_grammar": sorted(loaded() - third_party)}}))
"""


def test_generating_without_a_grammar_imports_no_platform_dependency(tiny_model_dir):
    """Building an engine and generating import none of the platform's dependencies beyond
    what transformers imports on its own; xgrammar comes with the first grammar, not before."""
    code = _GENERATE.format(model=str(tiny_model_dir), forbidden=PLATFORM_ONLY)
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"plain": [], "with_grammar": ["xgrammar"]}


def test_source_tree_maps_the_package_dirs_of_pyproject(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import source_tree
    finally:
        sys.path.remove(str(ROOT / "bench"))
    want = {"loramux.engine": "engine", "loramux.adapters": "adapters", "loramux.registry": "registry",
            "loramux.platform": "platform", "loramux.migrations": "migrations"}  # fmt: skip
    assert source_tree.package_dirs() == {k: ROOT / v for k, v in want.items()}
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10: no tomllib
    assert source_tree.package_dirs() == {k: ROOT / v for k, v in want.items()}
