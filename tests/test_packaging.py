"""The built wheel holds every module, and the repo root never shadows stdlib `platform`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = {
    "engine": "engine", "adapters": "adapters", "registry": "registry", "platform": "platform",
    "migrations": "migrations",
}


def test_wheel_contains_every_module(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), "-q"],
        check=True,
        cwd=tmp_path,
    )
    wheel = next(tmp_path.glob("loramux-*.whl"))
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
    for src in (ROOT / "engine" / "model" / "csrc").glob("*.[ch]"):  # CPU kernels, built on site
        expected.add(f"loramux/engine/model/csrc/{src.name}")
    missing = sorted(expected - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    assert not any(n.startswith(("engine/", "platform/", "registry/", "adapters/")) for n in names)
    # test helpers live in tests/support, never in the wheel
    assert not [n for n in names if n.endswith(("/testing.py", "/conftest.py")) or "/support/" in n]


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
