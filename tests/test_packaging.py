"""The built wheel holds every module and the compiled CPU kernels, its kernels load where no
compiler exists, and the repo root never shadows stdlib `platform`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {
    "engine": "engine", "adapters": "adapters", "registry": "registry", "platform": "platform",
    "migrations": "migrations",
}
EXTENSION = "loramux/engine/model/kernels/_C."


def _checkout(dest: Path) -> Path:
    """A clean checkout of this commit (a clone, as CI has), or the tree itself outside git."""
    if not (ROOT / ".git").exists():  # an unpacked sdist: build it as it is
        return ROOT
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, timeout=120)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    subprocess.run(["git", "-C", str(dest), "checkout", "-q", head], check=True)
    return dest


def _pip_wheel(src: Path, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``pip wheel`` against this venv's torch (``--no-build-isolation``, as ``make install``)."""
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-w", str(out), "-v"],
        cwd=out.parent, timeout=900, capture_output=True, text=True, env=env,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    proc = _pip_wheel(_checkout(tmp / "src"), tmp / "dist")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next((tmp / "dist").glob("loramux-*.whl"))


@pytest.mark.slow
def test_wheel_contains_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, sub in COMPONENTS.items():
        for py in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in py.parts:
                continue
            expected.add(f"loramux/{sub}/{py.relative_to(ROOT / folder).as_posix()}")
    for asset in (ROOT / "platform" / "admin").glob("*/*.*"):  # templates/, static/
        if asset.parent.name in ("templates", "static"):
            expected.add(f"loramux/platform/{asset.relative_to(ROOT / 'platform').as_posix()}")
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    # the CPU kernels as one compiled extension: the binary ships, its sources stay in the sdist
    assert [n for n in names if n.startswith(EXTENSION) and n.endswith(".so")], sorted(names)
    assert not [n for n in names if "/csrc/" in n]
    assert "-linux_" in wheel.name or "-macosx_" in wheel.name  # a platform wheel, not py3-none-any
    assert not any(n.startswith(("engine/", "platform/", "registry/", "adapters/")) for n in names)
    # test helpers live in tests/support, never in the wheel
    assert not [n for n in names if n.endswith(("/testing.py", "/conftest.py")) or "/support/" in n]


_LOAD_WITHOUT_COMPILER = """
import shutil, sys
site = sys.argv[1]
sys.path.insert(0, site)
import torch, torch.nn.functional as F
assert not any(shutil.which(c) for c in ("cc", "gcc", "c++", "g++", "clang")), "a compiler is on PATH"
from loramux.engine.model.kernels import loader, ops
assert loader.__file__.startswith(site), loader.__file__
st = loader.status()
assert st.available, st
gu = torch.randn(5, 64)
assert torch.allclose(ops.silu_mul(gu), F.silu(gu[:, :32]) * gu[:, 32:], atol=1e-6)
print("loaded", st.isa, ",".join(loader.isas()))
"""


@pytest.mark.slow
def test_the_wheels_kernels_load_without_a_compiler(wheel, tmp_path):
    """The wheel's binary runs on this CPU in a process whose PATH holds no compiler (a pod or
    an image without build tools): nothing is compiled at run time."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "PYTHONPATH")}
    env["PATH"] = str(empty)
    out = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_COMPILER, str(site)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("loaded "), out.stdout


@pytest.mark.slow
def test_a_kernel_that_does_not_compile_fails_the_build(tmp_path):
    """Where a compiler exists a broken kernel fails ``pip wheel`` (and ``make install``),
    naming the source, instead of installing an engine that silently runs on torch."""
    src = _checkout(tmp_path / "src")
    if src == ROOT:
        pytest.skip("not a git checkout")
    kernel = src / "engine" / "model" / "csrc" / "fused_ops.c"
    kernel.write_text(kernel.read_text() + "\nthis is not C;\n")
    (tmp_path / "dist").mkdir()
    proc = _pip_wheel(src, tmp_path / "dist")
    assert proc.returncode != 0
    assert "fused_ops.c" in proc.stdout + proc.stderr
    assert not list((tmp_path / "dist").glob("*.whl"))


@pytest.mark.slow
def test_without_a_compiler_the_build_leaves_the_kernels_out_and_says_so(tmp_path):
    src = _checkout(tmp_path / "src")
    if src == ROOT:
        pytest.skip("not a git checkout")
    missing = str(tmp_path / "no-such-compiler")
    env = {**os.environ, "CC": missing, "CXX": missing}
    (tmp_path / "dist").mkdir()
    proc = _pip_wheel(src, tmp_path / "dist", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the CPU kernels are NOT built" in proc.stdout + proc.stderr
    (whl,) = (tmp_path / "dist").glob("loramux-*.whl")
    assert not [n for n in zipfile.ZipFile(whl).namelist() if n.startswith(EXTENSION)]


def test_platform_folder_has_no_top_level_init():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_import_platform_is_the_standard_library():
    code = (
        "import platform, sys; "
        "assert hasattr(platform, 'python_version'), platform.__file__; "
        "import loramux.platform; import uuid, torch; print(platform.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(ROOT) not in out.stdout
