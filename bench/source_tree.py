"""Import ``loramux`` straight from this source tree when it is not installed.

The GPU machine runs the benchmarks with its own ``python3`` (its torch, triton,
transformers, ...) and reaches no package registry, so nothing is installed there. This
module maps ``loramux.<name>`` to the top-level folders exactly as
``[tool.setuptools.package-dir]`` in ``pyproject.toml`` does (``loramux.engine`` →
``engine/``, ...); deeper subpackages (``loramux.engine.lora``) resolve through their
parent's ``__path__`` as usual. Where loramux is installed (``make install``), the
installed package is used and nothing changes.

    from bench.source_tree import use_source_tree
    use_source_tree()  # before the first ``import loramux``
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{"loramux.engine": root/"engine", ...}`` from ``pyproject.toml``'s package-dir."""
    text = (root / "pyproject.toml").read_text()
    try:
        import tomllib

        table = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
    except ImportError:  # Python 3.10: read the one flat table by hand
        section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
        pairs = re.findall(r'^"([\w.]+)"\s*=\s*"([\w./-]+)"', section.group(1) if section else "", re.M)
        table = dict(pairs)
    if not table:
        raise RuntimeError(f"{root / 'pyproject.toml'} has no [tool.setuptools.package-dir]")
    return {name: root / folder for name, folder in table.items()}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``loramux`` (an empty namespace) and its top-level subpackages in the tree."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs
        self.top = {name.split(".")[0] for name in dirs}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.top:
            spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        folder = self.dirs.get(fullname)
        if folder is None:
            return None
        init = folder / "__init__.py"
        if init.is_file():
            return importlib.util.spec_from_file_location(
                fullname, init, submodule_search_locations=[str(folder)]
            )
        # a folder without __init__.py (platform/) is a namespace package
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        return spec


def use_source_tree(*, force: bool = False) -> str:
    """Make ``import loramux...`` work; returns ``"installed"`` or ``"source"``.

    ``force`` maps the source tree even where loramux is installed (tests of this module).
    Call it before anything imports loramux.
    """
    if any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        return "source"
    if not force and importlib.util.find_spec("loramux") is not None:
        return "installed"
    if "loramux" in sys.modules:
        raise RuntimeError("use_source_tree() must run before loramux is first imported")
    os.environ["LORAMUX_SOURCE_TREE"] = str(ROOT)  # tensor-parallel workers map it too
    sys.meta_path.insert(0, SourceTreeFinder(package_dirs()))
    return "source"


def load_test_support(name: str):
    """``tests/support/<name>.py`` (the tests' reference kernels and checks) as a module,
    loaded by path: ``tests/`` is no package, and another ``tests`` may be installed."""
    key = f"_loramux_test_support_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "tests" / "support" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module
