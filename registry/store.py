"""Object stores for adapter weights: the ``ObjectStore`` interface and ``FileStore``.

Keys are relative POSIX paths (``adapters/sha256/<hex>/adapter_model.safetensors``).
Reads verify sha256: ``get_file`` hashes while it copies and refuses a mismatch.
``S3Store`` (in :mod:`loramux.registry.s3`) implements the same interface on S3.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from loramux.registry.errors import ObjectIntegrityError, ObjectNotFound, ObjectStoreError
from loramux.registry.files import remove_old

_CHUNK = 1024 * 1024
_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,1023}$")


def check_key(key: str) -> str:
    """Refuse keys that could escape a prefix or a folder."""
    if not _KEY_RE.match(key) or ".." in key.split("/") or "//" in key or key.endswith("/"):
        raise ValueError(f"invalid object key {key!r}")
    return key


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


class ObjectStore(ABC):
    """Where adapter weights live. Implementations must be safe to use from several threads."""

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike, *, sha256: str | None = None) -> None:
        """Store the file at ``path`` under ``key`` (replacing any object there), atomically:
        readers see the old object or the whole new one. ``sha256`` is recorded with it."""

    @abstractmethod
    def get_file(self, key: str, dest: str | os.PathLike, *, sha256: str | None = None) -> None:
        """Copy the object to ``dest``, verifying ``sha256`` (or the one recorded at put time);
        on a mismatch ``dest`` is removed and :class:`ObjectIntegrityError` raised."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing object is not an error."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``."""

    @abstractmethod
    def describe(self) -> str:
        """A one-line description for logs and the CLI (no secrets)."""

    @abstractmethod
    def folder_uri(self, prefix: str) -> str:
        """Where the objects under ``prefix`` live, as a URI a person can use
        (``s3://bucket/...``, ``file:///...``): an export's answer."""

    def ping(self) -> None:
        """One round trip to the store; raises when it does not answer (``/ready``)."""
        self.exists("health/probe")

    def remove_leftovers(self, min_age_s: float) -> list[str]:
        """Remove what a writer killed mid-way left (temporary pieces, unfinished multipart
        uploads) older than ``min_age_s``; return what was removed. None by default."""
        return []


def discard(path: Path) -> None:
    """Remove a partial download (only ever a regular file)."""
    if path.is_file() and not path.is_symlink():
        path.unlink()


def _verify(key: str, got: str, want: str | None, dest: Path) -> None:
    """Raise ObjectIntegrityError on a mismatch, removing ``dest`` (the partial download)."""
    if want is not None and got != want:
        discard(dest)
        raise ObjectIntegrityError(
            f"object {key!r} is corrupt: sha256 {got} instead of {want}; re-upload the adapter"
        )


class FileStore(ObjectStore):
    """Objects as files under a root directory (the embedded default: ``<data dir>/objects``)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp = self.root / ".tmp"
        self._tmp.mkdir(exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def put_file(self, key: str, path: str | os.PathLike, *, sha256: str | None = None) -> None:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp / uuid.uuid4().hex
        h = hashlib.sha256()
        try:
            with open(path, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            _verify(key, h.hexdigest(), sha256, tmp)
            os.replace(tmp, target)
        except OSError as e:
            raise ObjectStoreError(f"cannot write {key!r} under {self.root}: {e}") from e
        finally:
            tmp.unlink(missing_ok=True)

    def get_file(self, key: str, dest: str | os.PathLike, *, sha256: str | None = None) -> None:
        source, dest = self._path(key), Path(dest)
        h = hashlib.sha256()
        try:
            with open(source, "rb") as src, open(dest, "wb") as out:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            discard(dest)
            raise ObjectNotFound(f"object {key!r} is missing from {self.root}") from None
        except OSError as e:
            discard(dest)
            raise ObjectStoreError(f"cannot read {key!r} under {self.root}: {e}") from e
        _verify(key, h.hexdigest(), sha256, dest)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        path = self._path(key)
        path.unlink(missing_ok=True)
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for filename in sorted(filenames):
                path = Path(dirpath) / filename
                key = path.relative_to(self.root).as_posix()
                if not key.startswith(prefix):
                    continue
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                yield ObjectInfo(
                    key, st.st_size, datetime.fromtimestamp(st.st_mtime, tz=timezone.utc)
                )

    def remove_leftovers(self, min_age_s: float) -> list[str]:
        return [f".tmp/{n}" for n in remove_old(self._tmp, min_age_s)]

    def describe(self) -> str:
        return f"file store at {self.root}"

    def folder_uri(self, prefix: str) -> str:
        return self.root.joinpath(*prefix.split("/")).resolve().as_uri() + "/"
