"""Archives: good ones load, hostile ones are refused before anything is written outside."""

from __future__ import annotations

import io
import pickle
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from loramux.adapters.archive import adapter_folder, extract_archive
from loramux.adapters.format import AdapterValidationError, load_adapter, validate_adapter


def tar_of(path: Path, members: dict[str, bytes], *, prefix: str = "") -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def zip_of(path: Path, members: dict[str, bytes], *, prefix: str = "") -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(prefix + name, data)
    return path


def files(folder: Path) -> dict[str, bytes]:
    return {
        "adapter_config.json": (folder / "adapter_config.json").read_bytes(),
        "adapter_model.safetensors": (folder / "adapter_model.safetensors").read_bytes(),
    }


@pytest.mark.parametrize("kind", ["tar", "zip"])
@pytest.mark.parametrize("prefix", ["", "my-adapter/", "./"])
def test_good_archives(peft_adapter, tiny_config, tmp_path, kind, prefix):
    make = tar_of if kind == "tar" else zip_of
    path = make(
        tmp_path / f"a.{'tar.gz' if kind == 'tar' else 'zip'}", files(peft_adapter), prefix=prefix
    )
    w = validate_adapter(path, tiny_config)
    assert w.spec.r == 4
    assert load_adapter(path).num_bytes() == w.num_bytes()


def test_archive_with_readme_is_fine(peft_adapter, tiny_config, tmp_path):
    members = files(peft_adapter) | {"README.md": b"# hi\n"}
    validate_adapter(zip_of(tmp_path / "a.zip", members), tiny_config)


def test_temp_folder_removed(peft_adapter, tmp_path):
    path = zip_of(tmp_path / "a.zip", files(peft_adapter))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with adapter_folder(path, tmp_dir=scratch) as folder:
        assert (folder / "adapter_config.json").exists()
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize(
    "name", ["../evil.json", "a/../../evil.json", "/tmp/evil.json", "..\\evil"]
)
@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_zip_slip(peft_adapter, tiny_config, tmp_path, name, kind):
    make = tar_of if kind == "tar" else zip_of
    path = make(tmp_path / "a.bin.archive", files(peft_adapter) | {name: b"{}"})
    with pytest.raises(AdapterValidationError, match="refused") as e:
        validate_adapter(path, tiny_config)
    assert e.value.field == name
    assert not (tmp_path / "evil.json").exists() and not Path("/tmp/evil.json").exists()


def test_tar_symlink_member(peft_adapter, tiny_config, tmp_path):
    path = tmp_path / "a.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.type = tarfile.SYMTYPE
        info.linkname = "/etc/passwd"
        tf.addfile(info)
        cfg = files(peft_adapter)["adapter_config.json"]
        ci = tarfile.TarInfo("adapter_config.json")
        ci.size = len(cfg)
        tf.addfile(ci, io.BytesIO(cfg))
    with pytest.raises(AdapterValidationError, match="links are refused") as e:
        validate_adapter(path, tiny_config)
    assert e.value.field == "adapter_model.safetensors"


def test_tar_hardlink_member(tmp_path):
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tf:
        info = tarfile.TarInfo("x")
        info.type = tarfile.LNKTYPE
        info.linkname = "../../etc/passwd"
        tf.addfile(info)
    with pytest.raises(AdapterValidationError, match="links are refused"):
        extract_archive(path, tmp_path / "out")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE])
def test_tar_device_member(tmp_path, kind):
    path = tmp_path / "a.tar"
    with tarfile.open(path, "w") as tf:
        info = tarfile.TarInfo("dev")
        info.type = kind
        tf.addfile(info)
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterValidationError, match="devices, fifos"):
        extract_archive(path, tmp_path / "out")


def test_zip_symlink_member(peft_adapter, tiny_config, tmp_path):
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo("adapter_model.safetensors")
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(info, "/etc/passwd")
        zf.writestr("adapter_config.json", files(peft_adapter)["adapter_config.json"])
    with pytest.raises(AdapterValidationError, match="links are refused"):
        validate_adapter(path, tiny_config)


def test_too_many_members(tmp_path):
    path = zip_of(tmp_path / "a.zip", {f"f{i}.txt": b"x" for i in range(100)})
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterValidationError, match="more than 64"):
        extract_archive(path, tmp_path / "out")
    tpath = tar_of(tmp_path / "a.tar.gz", {f"f{i}.txt": b"x" for i in range(100)})
    (tmp_path / "out2").mkdir()
    with pytest.raises(AdapterValidationError, match="more than 64"):
        extract_archive(tpath, tmp_path / "out2")


@pytest.mark.parametrize("kind", ["tar", "zip"])
def test_decompression_bomb(tmp_path, kind):
    make = tar_of if kind == "tar" else zip_of
    path = make(tmp_path / "bomb", {"adapter_model.safetensors": b"\0" * (4 * 1024 * 1024)})
    assert path.stat().st_size < 64 * 1024
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterValidationError, match="exceeds the limit"):
        extract_archive(path, tmp_path / "out", max_total_bytes=1024 * 1024)


def test_oversized_archive_refused_before_extraction(peft_adapter, tiny_config, tmp_path):
    path = zip_of(tmp_path / "a.zip", files(peft_adapter))
    with pytest.raises(AdapterValidationError, match="above the limit"):
        validate_adapter(path, tiny_config, max_bytes=1000)


def test_pickle_member_in_archive(tmp_path, peft_adapter, tiny_config):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    members = files(peft_adapter) | {"training_args.bin": pickle.dumps(Payload())}
    for make in (tar_of, zip_of):
        with pytest.raises(AdapterValidationError, match="pickle") as e:
            validate_adapter(make(tmp_path / f"a-{make.__name__}", members), tiny_config)
        assert e.value.field == "training_args.bin"
    assert not marker.exists()


def test_duplicate_member(tmp_path):
    path = tmp_path / "a.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("x.json", b"1")
        zf.writestr("x.json", b"2")
    (tmp_path / "out").mkdir()
    with pytest.raises(AdapterValidationError, match="twice"):
        extract_archive(path, tmp_path / "out")


def test_corrupt_archive(tmp_path, tiny_config):
    path = tmp_path / "a.tar.gz"
    path.write_bytes(b"\x1f\x8b" + b"garbage" * 20)
    with pytest.raises(AdapterValidationError, match="corrupt archive"):
        validate_adapter(path, tiny_config)


def test_not_an_archive(tmp_path, tiny_config):
    path = tmp_path / "adapter.txt"
    path.write_text("hello")
    with pytest.raises(AdapterValidationError, match="expected an adapter folder"):
        validate_adapter(path, tiny_config)
