"""The local disk cache of adapter folders (``<data dir>/cache/adapters``).

Each entry is a PEFT folder named after the content it holds
(``<weights sha256>-<config digest>``): the weights fetched from the object store with
their sha256 verified, and ``adapter_config.json`` written from the registry row.
Entries appear atomically (built in a temporary folder, then renamed), so concurrent
fetches of one adapter are safe.

The cache is not trusted blindly: the entry's marker records each file's size and
modification time. Every use compares them (two ``stat`` calls); on any difference the
files are hashed again, and a copy that no longer matches its digests is discarded (and
fetched again by :meth:`AdapterCache.fetch`), logged as an error. Temporary folders a
killed process left behind are removed by :meth:`AdapterCache.remove_leftovers`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loramux.adapters.archive import CONFIG_NAME, WEIGHTS_NAME
from loramux.registry.files import remove_old, sha256_file
from loramux.registry.store import ObjectStore

logger = logging.getLogger(__name__)

_MARKER = ".complete"
_TMP_PREFIX = ".tmp-"


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def cache_entry_name(sha256: str, config: dict[str, Any]) -> str:
    return f"{sha256}-{config_digest(config)[:16]}"


def _stamp(folder: Path) -> dict[str, list[int]]:
    """``{file: [size, mtime_ns]}`` of an entry's two files."""
    out = {}
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        st = (folder / name).stat()
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


class AdapterCache:
    """Fetch-on-first-use folders of adapters, keyed by content, verified on every use."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path_for(self, sha256: str, config: dict[str, Any]) -> Path:
        return self.root / cache_entry_name(sha256, config)

    def lookup(self, sha256: str, config: dict[str, Any]) -> Path | None:
        """The local folder of an adapter when the cache holds a good copy, else None (a
        tampered or damaged copy is discarded here; no fetch)."""
        target = self.path_for(sha256, config)
        return target if self._verified(target, sha256, config) else None

    def _verified(self, target: Path, sha256: str, config: dict[str, Any]) -> bool:
        marker = target / _MARKER
        try:
            recorded = json.loads(marker.read_text())
            if isinstance(recorded, dict) and recorded == _stamp(target):
                return True
        except FileNotFoundError:
            if not target.exists():
                return False
            recorded = None
        except (OSError, ValueError):
            recorded = None
        # the stamp differs (or is from an older loramux): hash the files again
        try:
            good = (sha256_file(target / WEIGHTS_NAME) == sha256 and
                    config_digest(json.loads((target / CONFIG_NAME).read_text())) ==
                    config_digest(config))
        except (OSError, ValueError):
            good = False
        if good:
            self._write_marker(target)
            return True
        logger.error("adapter cache entry %s does not match its digest (changed on disk); "
                     "discarding it, it will be fetched again", target.name)
        self._discard(target)
        return False

    @staticmethod
    def _write_marker(folder: Path) -> None:
        tmp = folder / f"{_MARKER}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps(_stamp(folder)))
        os.replace(tmp, folder / _MARKER)

    def _discard(self, target: Path) -> None:
        with self._lock:
            aside = self.root / f"{_TMP_PREFIX}bad-{uuid.uuid4().hex}"
            try:
                target.rename(aside)  # out of the way at once, removed after
            except OSError:
                return
        shutil.rmtree(aside, ignore_errors=True)

    def fetch(self, store: ObjectStore, key: str, sha256: str, config: dict[str, Any]) -> Path:
        """Return the local folder of an adapter, downloading it first if needed (or if
        the cached copy no longer matches its digests)."""
        target = self.path_for(sha256, config)
        if self._verified(target, sha256, config):
            return target
        tmp = self.root / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            store.get_file(key, tmp / WEIGHTS_NAME, sha256=sha256)
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            self._write_marker(tmp)
            with self._lock:
                if (target / _MARKER).is_file():
                    return target
                if target.exists():
                    shutil.rmtree(target, ignore_errors=True)
                try:
                    tmp.rename(target)
                except OSError:
                    if not (target / _MARKER).is_file():
                        raise
            return target
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def entries(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if not p.name.startswith("."))

    def remove(self, name: str) -> None:
        """Remove one entry (no error when it is absent)."""
        if name and not name.startswith(".") and "/" not in name:
            shutil.rmtree(self.root / name, ignore_errors=True)

    def prune(self, keep: Iterable[str]) -> list[str]:
        """Remove every entry whose name is not in ``keep``; return the removed names."""
        keep = set(keep)
        removed = []
        for name in self.entries():
            if name not in keep:
                shutil.rmtree(self.root / name, ignore_errors=True)
                removed.append(name)
        return removed

    def remove_leftovers(self, min_age_s: float) -> list[str]:
        """Remove temporary folders (a fetch a killed process never finished) older than
        ``min_age_s``; return their names."""
        return remove_old(self.root, min_age_s, prefix=_TMP_PREFIX)
