"""The local disk cache of adapter folders (``<data dir>/cache/adapters``).

Each entry is a PEFT folder named after the content it holds
(``<weights sha256>-<config digest>``): the weights fetched from the object store with
their sha256 verified, and ``adapter_config.json`` written from the registry row.
Entries appear atomically (built in a temporary folder, then renamed), so concurrent
fetches of one adapter are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from loramux.adapters.archive import CONFIG_NAME, WEIGHTS_NAME
from loramux.registry.store import ObjectStore

_MARKER = ".complete"


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def cache_entry_name(sha256: str, config: dict[str, Any]) -> str:
    return f"{sha256}-{config_digest(config)[:16]}"


class AdapterCache:
    """Fetch-on-first-use folders of adapters, keyed by content."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def path_for(self, sha256: str, config: dict[str, Any]) -> Path:
        return self.root / cache_entry_name(sha256, config)

    def lookup(self, sha256: str, config: dict[str, Any]) -> Path | None:
        """The local folder of an adapter when it is already cached, else None (no fetch)."""
        target = self.path_for(sha256, config)
        return target if (target / _MARKER).is_file() else None

    def fetch(self, store: ObjectStore, key: str, sha256: str, config: dict[str, Any]) -> Path:
        """Return the local folder of an adapter, downloading it first if needed."""
        target = self.path_for(sha256, config)
        if (target / _MARKER).is_file():
            return target
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            store.get_file(key, tmp / WEIGHTS_NAME, sha256=sha256)
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            (tmp / _MARKER).write_text("ok\n")
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

    def prune(self, keep: Iterable[str]) -> list[str]:
        """Remove every entry whose name is not in ``keep``; return the removed names."""
        keep = set(keep)
        removed = []
        for name in self.entries():
            if name not in keep:
                shutil.rmtree(self.root / name, ignore_errors=True)
                removed.append(name)
        return removed
