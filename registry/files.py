"""Plain file helpers the registry's stores, cache and gc share: a file's sha256, and the
removal of crash leftovers (entries of a folder nothing touched for a while)."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

_CHUNK = 1024 * 1024


def sha256_file(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def remove_old(folder: Path, min_age_s: float, *, prefix: str = "") -> list[str]:
    """Remove the entries of ``folder`` whose name starts with ``prefix`` and that nothing
    touched for ``min_age_s`` seconds (crash leftovers); return their names."""
    if not folder.is_dir():
        return []
    cutoff = time.time() - min_age_s
    removed = []
    for path in folder.iterdir():
        if not path.name.startswith(prefix) or path.is_symlink():
            continue
        try:
            if _newest_mtime(path) > cutoff:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(path.name)
    return removed


def _newest_mtime(path: Path) -> float:
    """The latest modification time under ``path`` (an upload still being written is new)."""
    newest = path.lstat().st_mtime
    if path.is_dir():
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                try:
                    newest = max(newest, os.lstat(os.path.join(dirpath, name)).st_mtime)
                except OSError:
                    continue
    return newest
