"""Turn an upload (a folder or one ``.tar.gz`` / ``.zip`` archive) into a local adapter folder.

Archives are extracted by hand, member by member: no absolute paths, no ``..``, no links,
no devices or fifos, no encrypted members, a cap on the member count and on the total
extracted size. Pickle-based files are refused wherever they appear.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from loramux.adapters.errors import PICKLE_SUFFIXES, AdapterValidationError, pickle_refusal
from loramux.adapters.safetensors_io import looks_like_pickle

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
MAX_MEMBERS = 64
DEFAULT_MAX_EXTRACT_BYTES = 4 * 1024**3
_CHUNK = 1024 * 1024


def archive_kind(path: str | os.PathLike) -> str | None:
    """``"tar"`` or ``"zip"`` by the file's first bytes (gzip'd or plain tar), else ``None``."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if head.startswith(b"\x1f\x8b") or (len(head) >= 262 and head[257:262] == b"ustar"):
        return "tar"
    return None


def is_pickle_name(name: str) -> bool:
    return name.lower().endswith(PICKLE_SUFFIXES)


def _safe_relpath(name: str) -> PurePosixPath:
    """The member's path inside the destination, or a refusal naming the member."""
    if "\\" in name or "\x00" in name:
        raise AdapterValidationError(
            f"archive member {name!r}: backslashes and NUL are refused", field=name
        )
    p = PurePosixPath(name)
    if p.is_absolute() or name.startswith("/"):
        raise AdapterValidationError(
            f"archive member {name!r}: absolute paths are refused", field=name
        )
    parts = [part for part in p.parts if part not in ("", ".")]
    if any(part == ".." for part in parts):
        raise AdapterValidationError(
            f"archive member {name!r}: '..' in a path is refused", field=name
        )
    if parts and ":" in parts[0]:
        raise AdapterValidationError(
            f"archive member {name!r}: drive letters are refused", field=name
        )
    return PurePosixPath(*parts) if parts else PurePosixPath(".")


class _Budget:
    def __init__(self, max_members: int, max_bytes: int) -> None:
        self.max_members, self.max_bytes = max_members, max_bytes
        self.members = 0
        self.bytes = 0

    def member(self, name: str) -> None:
        self.members += 1
        if self.members > self.max_members:
            raise AdapterValidationError(
                f"archive: more than {self.max_members} members", field="archive"
            )

    def copy(self, src: BinaryIO, dest: Path, name: str) -> None:
        with open(dest, "xb") as out:
            while chunk := src.read(_CHUNK):
                self.bytes += len(chunk)
                if self.bytes > self.max_bytes:
                    raise AdapterValidationError(
                        f"archive: extracted size exceeds the limit of {self.max_bytes} bytes",
                        field="archive",
                    )
                out.write(chunk)


def _target(dest: Path, rel: PurePosixPath, name: str) -> Path:
    target = dest.joinpath(*rel.parts)
    if target.exists():
        raise AdapterValidationError(f"archive member {name!r} appears twice", field=name)
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def _extract_tar(path: Path, dest: Path, budget: _Budget) -> None:
    with tarfile.open(path, mode="r:*") as tf:
        while (member := tf.next()) is not None:
            budget.member(member.name)
            rel = _safe_relpath(member.name)
            if member.issym() or member.islnk():
                raise AdapterValidationError(
                    f"archive member {member.name!r}: links are refused", field=member.name
                )
            if member.isdir():
                dest.joinpath(*rel.parts).mkdir(parents=True, exist_ok=True)
                continue
            if not member.isreg() or member.issparse():
                raise AdapterValidationError(
                    f"archive member {member.name!r}: only regular files and folders are accepted "
                    "(devices, fifos and sparse files are refused)",
                    field=member.name,
                )
            if is_pickle_name(member.name):
                raise pickle_refusal(member.name)
            if budget.bytes + member.size > budget.max_bytes:
                raise AdapterValidationError(
                    f"archive: extracted size exceeds the limit of {budget.max_bytes} bytes",
                    field="archive",
                )
            src = tf.extractfile(member)
            assert src is not None
            with src:
                budget.copy(src, _target(dest, rel, member.name), member.name)


def _extract_zip(path: Path, dest: Path, budget: _Budget) -> None:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        if len(infos) > budget.max_members:
            raise AdapterValidationError(
                f"archive: {len(infos)} members, more than {budget.max_members}", field="archive"
            )
        for info in infos:
            budget.member(info.filename)
            rel = _safe_relpath(info.filename)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise AdapterValidationError(
                    f"archive member {info.filename!r}: links are refused", field=info.filename
                )
            if info.flag_bits & 0x1:
                raise AdapterValidationError(
                    f"archive member {info.filename!r}: encrypted members are refused",
                    field=info.filename,
                )
            if info.is_dir():
                dest.joinpath(*rel.parts).mkdir(parents=True, exist_ok=True)
                continue
            if stat.S_IFMT(mode) not in (0, stat.S_IFREG):
                raise AdapterValidationError(
                    f"archive member {info.filename!r}: only regular files and folders are accepted",
                    field=info.filename,
                )
            if is_pickle_name(info.filename):
                raise pickle_refusal(info.filename)
            if budget.bytes + info.file_size > budget.max_bytes:
                raise AdapterValidationError(
                    f"archive: extracted size exceeds the limit of {budget.max_bytes} bytes",
                    field="archive",
                )
            with zf.open(info) as src:
                budget.copy(src, _target(dest, rel, info.filename), info.filename)


def extract_archive(
    path: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    max_members: int = MAX_MEMBERS,
    max_total_bytes: int = DEFAULT_MAX_EXTRACT_BYTES,
) -> None:
    """Extract a ``.tar``/``.tar.gz``/``.zip`` into the empty folder ``dest`` safely."""
    path, dest = Path(path), Path(dest)
    kind = archive_kind(path)
    budget = _Budget(max_members, max_total_bytes)
    try:
        if kind == "zip":
            _extract_zip(path, dest, budget)
        elif kind == "tar":
            _extract_tar(path, dest, budget)
        else:
            raise AdapterValidationError(
                f"{path.name}: not a .tar.gz or .zip archive", field="archive"
            )
    except AdapterValidationError:
        raise
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
        raise AdapterValidationError(
            f"{path.name}: corrupt archive ({e})", field="archive"
        ) from None


def _find_adapter_root(folder: Path) -> Path:
    """The folder holding adapter_config.json: ``folder`` itself or its one subfolder."""
    if (folder / CONFIG_NAME).exists() or (folder / WEIGHTS_NAME).exists():
        return folder
    entries = [p for p in folder.iterdir() if not p.name.startswith(".") and p.name != "__MACOSX"]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
        return entries[0]
    return folder


def check_folder(folder: Path) -> None:
    """Refuse pickle files and links anywhere in an adapter folder."""
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            raise AdapterValidationError(f"{rel}: links are refused", field=rel)
        if p.is_file() and is_pickle_name(p.name):
            raise pickle_refusal(rel)


@contextmanager
def adapter_folder(
    source: str | os.PathLike,
    *,
    max_bytes: int = DEFAULT_MAX_EXTRACT_BYTES,
    tmp_dir: str | os.PathLike | None = None,
) -> Iterator[Path]:
    """Yield a local folder holding the adapter files of ``source``.

    ``source`` is a folder, or one archive (extracted into a temporary folder that is
    removed afterwards). Single pickle files and empty files are refused here.
    """
    source = Path(source)
    if not source.exists():
        raise AdapterValidationError(f"{source}: no such file or folder", field="source")
    if source.is_dir():
        check_folder(source)
        yield _find_adapter_root(source)
        return
    name = source.name
    if source.stat().st_size == 0:
        raise AdapterValidationError(f"{name} is empty", field=name)
    if is_pickle_name(name):
        raise pickle_refusal(name)
    kind = archive_kind(source)
    if kind is None:
        with open(source, "rb") as f:
            head = f.read(8)
        if looks_like_pickle(head):
            raise pickle_refusal(name)
        raise AdapterValidationError(
            f"{name}: expected an adapter folder (adapter_config.json + adapter_model.safetensors) "
            "or one .tar.gz / .zip archive of it",
            field="source",
        )
    if source.stat().st_size > max_bytes:
        raise AdapterValidationError(
            f"{name}: {source.stat().st_size} bytes, above the limit of {max_bytes}", field="size"
        )
    tmp = Path(tempfile.mkdtemp(prefix="loramux-adapter-", dir=tmp_dir))
    try:
        extract_archive(source, tmp, max_total_bytes=max_bytes)
        check_folder(tmp)
        yield _find_adapter_root(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
