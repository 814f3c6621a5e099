"""The bad-input corpus through ``RegistryService.upload``: every case is refused with
its documented error, and nothing is stored (no row, no object, no scratch files)."""

from __future__ import annotations

import io
import json
import pickle
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sqlalchemy import func, select

from loramux.adapters.errors import AdapterValidationError
from loramux.registry import InvalidName
from loramux.registry.models import Adapter, AdapterEvent
from loramux.registry.service import OBJECT_PREFIX

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
KEY_B = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


class Marker:
    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


def _tensors(src: Path, fn) -> Path:
    t = load_file(str(src / WEIGHTS))
    fn(t)
    save_file(t, str(src / WEIGHTS))
    return src


def _config(src: Path, **changes) -> Path:
    cfg = json.loads((src / CONFIG).read_text())
    cfg.update(changes)
    (src / CONFIG).write_text(json.dumps(cfg))
    return src


def pickle_file(src: Path, tmp: Path) -> Path:
    m = Marker()
    m.path = str(tmp / "MARKER")
    (src / "adapter_model.bin").write_bytes(pickle.dumps({"w": m}))
    (src / WEIGHTS).unlink()
    return src


def pickle_as_safetensors(src: Path, tmp: Path) -> Path:
    m = Marker()
    m.path = str(tmp / "MARKER")
    (src / WEIGHTS).write_bytes(pickle.dumps({"w": m}))
    return src


def zip_slip(src: Path, tmp: Path) -> Path:
    path = tmp / "slip.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(src / CONFIG, CONFIG)
        zf.write(src / WEIGHTS, WEIGHTS)
        zf.writestr("../../MARKER", b"x")
    return path


def symlink_member(src: Path, tmp: Path) -> Path:
    path = tmp / "link.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        tf.add(src / CONFIG, CONFIG)
        info = tarfile.TarInfo(WEIGHTS)
        info.type = tarfile.SYMTYPE
        info.linkname = str(tmp / "MARKER")
        tf.addfile(info)
    return path


def nan_weights(src: Path, tmp: Path) -> Path:
    return _tensors(src, lambda t: t[KEY_B].__setitem__((0, 0), float("nan")))


def wrong_shape(src: Path, tmp: Path) -> Path:
    return _tensors(src, lambda t: t.__setitem__(KEY_B, torch.zeros(64, 4)))


def missing_tensor(src: Path, tmp: Path) -> Path:
    return _tensors(src, lambda t: t.pop(KEY_B))


def rank_above_limit(src: Path, tmp: Path) -> Path:
    return src  # made with r=32 > max_lora_rank=16, see CASES


def unknown_module(src: Path, tmp: Path) -> Path:
    return _config(src, target_modules=["q_proj", "v_proj", "c_attn"])


def dora_without_magnitudes(src: Path, tmp: Path) -> Path:
    return _config(src, use_dora=True)


def invalid_json(src: Path, tmp: Path) -> Path:
    (src / CONFIG).write_text('{"peft_type": "LORA", "r": 4,,}')
    return src


def empty_file(src: Path, tmp: Path) -> Path:
    path = tmp / "empty.tar.gz"
    path.write_bytes(b"")
    return path


def empty_weights(src: Path, tmp: Path) -> Path:
    (src / WEIGHTS).write_bytes(b"")
    return src


def oversized(src: Path, tmp: Path) -> Path:
    return src  # made with r=16 on all modules (> 64 KiB), see CASES


def oversized_archive(src: Path, tmp: Path) -> Path:
    path = tmp / "big.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        tf.add(src / CONFIG, CONFIG)
        data = b"\0" * (2 * 1024 * 1024)
        info = tarfile.TarInfo(WEIGHTS)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return path


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = [
    # (builder, adapter kwargs, expected error, message pattern)
    (pickle_file, {}, AdapterValidationError, "pickle-based files are refused.*safetensors"),
    (pickle_as_safetensors, {}, AdapterValidationError, "pickle"),
    (zip_slip, {}, AdapterValidationError, r"'\.\.' in a path is refused"),
    (symlink_member, {}, AdapterValidationError, "links are refused"),
    (nan_weights, {}, AdapterValidationError, "NaN or infinite"),
    (wrong_shape, {}, AdapterValidationError, r"shape \[64, 4\], expected \[32, 4\]"),
    (missing_tensor, {}, AdapterValidationError, "missing tensor"),
    (rank_above_limit, {"r": 32}, AdapterValidationError, "above max_lora_rank=16"),
    (unknown_module, {}, AdapterValidationError, "'c_attn' is not a supported target module"),
    (dora_without_magnitudes, {}, AdapterValidationError, r"lora_magnitude_vector: missing tensor"),
    (invalid_json, {}, AdapterValidationError, "invalid JSON"),
    (empty_file, {}, AdapterValidationError, "is empty"),
    (empty_weights, {}, AdapterValidationError, "is empty"),
    (oversized, {"r": 16, "target_modules": ALL}, AdapterValidationError, "above the limit"),
    (oversized_archive, {}, AdapterValidationError, "limit"),
]


def assert_nothing_stored(registry, tmp_path: Path) -> None:
    with registry.db.session() as s:
        assert s.scalar(select(func.count()).select_from(Adapter)) == 0
        assert s.scalar(select(func.count()).select_from(AdapterEvent)) == 0
    assert list(registry.store.list(OBJECT_PREFIX)) == []
    assert list(registry.tmp_dir.iterdir()) == []
    assert not (tmp_path / "MARKER").exists()
    assert not any(p.name == "MARKER" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("build, kwargs, error, match", CASES, ids=[c[0].__name__ for c in CASES])
def test_bad_adapter_refused_and_nothing_stored(
    registry, make_adapter, tmp_path, build, kwargs, error, match
):
    registry.create_tenant("acme")
    source = build(make_adapter(**kwargs), tmp_path)
    with pytest.raises(error, match=match):
        registry.upload("acme", "bad", source)
    assert_nothing_stored(registry, tmp_path)


BAD_NAMES = ["a/b", "..", "a..b", "../etc", "with space", "x" * 129, "", ".hidden", "-dash", "é"]


def test_bad_names_refused(registry, make_adapter, tmp_path):
    registry.create_tenant("acme")
    source = make_adapter()
    for name in BAD_NAMES:
        with pytest.raises(InvalidName, match="invalid adapter name"):
            registry.upload("acme", name, source)
        with pytest.raises(InvalidName, match="invalid tenant name"):
            registry.create_tenant(name)
    assert_nothing_stored(registry, tmp_path)


def test_longest_name_accepted(registry, make_adapter):
    registry.create_tenant("acme")
    name = "a" + "b.c_d-" * 21 + "x"
    assert len(name) == 128
    assert registry.upload("acme", name, make_adapter()).name == name
