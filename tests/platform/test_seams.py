"""Seams and names, checked over the product's source: one class per name, one reader of
``LORAMUX_*`` variables, a typed application state (no ``getattr(app.state, ...)``
probing), and settings whose help is declared, so it works where only ``.pyc`` ships."""

from __future__ import annotations

import ast
import compileall
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "adapters", "registry", "platform")
ENV_READERS = {"platform/settings.py", "engine/envs.py"}
"""The one place each side reads ``LORAMUX_*``: the service's Settings, the engine's envs."""


def product_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_class_names_are_unique_in_the_product():
    where: dict[str, list[str]] = defaultdict(list)
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(_rel(path))
    dupes = {name: files for name, files in where.items() if len(files) > 1}
    assert not dupes, f"one class per name: {dupes}"


def _string_constants(tree: ast.AST) -> list[ast.Constant]:
    """String literals that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
        if isinstance(node, (ast.ClassDef, ast.Module)):  # attribute docstrings
            for stmt in node.body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    docs.add(id(stmt.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def test_loramux_variables_are_read_in_one_place():
    readers = []
    for path in [*product_files(), ROOT / "migrations" / "env.py"]:
        tree = ast.parse(path.read_text())
        literal = any("LORAMUX_" in c.value and "LORAMUX_*" not in c.value
                      and not c.value.startswith(("--", "error:"))
                      for c in _string_constants(tree))
        environ = "environ" in path.read_text() or "getenv" in path.read_text()
        if literal and environ:
            readers.append(_rel(path))
    stray = sorted(set(readers) - ENV_READERS)
    assert not stray, f"read LORAMUX_* through Settings (or engine/envs.py): {stray}"
    assert ENV_READERS <= set(readers)  # the list is current


def test_no_getattr_probing_of_app_state():
    offenders = []
    for path in product_files():
        text = path.read_text()
        for needle in ("getattr(app.state", "getattr(request.app.state", ".app.state.",
                       "app.state."):
            if needle in text:
                offenders.append(f"{_rel(path)}: {needle}")
    assert not offenders, offenders


def test_settings_help_is_declared_not_read_from_source():
    """Importing the settings never reads a loramux source file: with every way to read
    one closed, each field still has its description (the ``--help`` text)."""
    code = (
        "import inspect, linecache\n"
        "def closed(real):\n"
        "    def read(obj, *a, **k):\n"
        "        module = inspect.getmodule(obj)\n"
        "        if module is not None and module.__name__.startswith('loramux'):\n"
        "            raise OSError(f'read the source of {obj!r}: only .pyc may ship')\n"
        "        return real(obj, *a, **k)\n"
        "    return read\n"
        "for name in ('getsource', 'getsourcelines', 'findsource'):\n"
        "    setattr(inspect, name, closed(getattr(inspect, name)))\n"
        "getlines = linecache.getlines\n"
        f"ROOT = {str(ROOT)!r}\n"
        "def ours(f):\n"
        "    return f.startswith(ROOT) and not f.startswith(ROOT + '/.venv')\n"
        "linecache.getlines = lambda f, *a, **k: [] if ours(f) else getlines(f, *a, **k)\n"
        "from loramux.platform.settings import Settings\n"
        "missing = [n for n, f in Settings.model_fields.items() if not f.description]\n"
        "assert not missing, missing\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_serve_help_runs_from_compiled_files_only(tmp_path):
    """``loramux serve --help`` from a copy of the package holding only ``.pyc`` files."""
    pkg = tmp_path / "loramux"
    pkg.mkdir()
    for name in PACKAGES:
        shutil.copytree(ROOT / name, pkg / name, ignore=shutil.ignore_patterns("__pycache__"))
    assert compileall.compile_dir(pkg, quiet=1, legacy=True)
    for source in pkg.rglob("*.py"):
        source.unlink()
    code = (
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import loramux.platform.settings as s\n"
        "assert s.__file__.endswith('.pyc'), s.__file__\n"
        "from loramux.platform.cli import main\n"
        "main(['serve', '--help'])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAMUX_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--max-loras" in out.stdout and "Most ``stop`` strings" in out.stdout.replace("\n", " ")
