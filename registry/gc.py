"""Garbage collection: objects no row references, pending-upload markers, cache entries of
adapters that are gone, and what a killed process left behind.

An upload writes a *pending marker* (``pending/<sha256>/<id>``) before the weights and
removes it once the row is committed (or the upload failed). So ``gc`` tells an upload
in progress (its marker is there) from an orphan (stored, never committed: no marker, no
row), and removes an orphan after a short grace instead of an hour. A marker older than
``leftover_age_s`` belongs to a process that died mid-upload: it goes, and so does its
object if no row uses it. Scratch folders (uploads, archives being unpacked, cache
fetches, the file store's temporary pieces, S3 multipart uploads never completed) older
than ``leftover_age_s`` are removed here and at every start (:func:`remove_leftovers`).
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

from loramux.registry.cache import cache_entry_name
from loramux.registry.files import remove_old
from loramux.registry.models import AdapterVersion

if TYPE_CHECKING:
    from loramux.registry.cache import AdapterCache
    from loramux.registry.db import Database
    from loramux.registry.store import ObjectStore

logger = logging.getLogger(__name__)

OBJECT_PREFIX = "adapters/sha256/"
PENDING_PREFIX = "pending/"
DEFAULT_GC_MIN_AGE_S = 60.0
"""Grace of an unreferenced object without a pending marker (store listings may lag)."""
LEFTOVER_AGE_S = 900.0
"""Age past which a scratch folder, temporary piece or pending marker is a crash leftover
(an upload still in progress writes or renews them)."""


@dataclass(frozen=True)
class Storage:
    """Where the registry keeps things: the rows, the stored weights, the local disk cache
    of adapter folders and the scratch folder (None: the system's temporary folder)."""

    db: Database
    store: ObjectStore
    cache: AdapterCache
    tmp_dir: Path | None = None


@dataclass(frozen=True)
class GcReport:
    deleted_objects: list[str]
    pruned_cache_entries: list[str]
    removed_leftovers: list[str] = field(default_factory=list)
    """Scratch folders, temporary pieces and stale pending markers removed."""


@contextmanager
def pending_marker(store: ObjectStore, digest: str, tmp_dir: Path | None):
    """Mark an upload of ``digest`` as in progress while the block runs (removed after,
    whether it committed or failed)."""
    key = f"{PENDING_PREFIX}{digest}/{uuid.uuid4().hex}"
    fd, path = tempfile.mkstemp(prefix="pending-", dir=tmp_dir)
    try:
        os.write(fd, b"upload in progress\n")
        os.close(fd)
        store.put_file(key, path)
    finally:
        os.unlink(path)
    try:
        yield key
    finally:
        try:
            store.delete(key)
        except Exception:  # gc removes it once it is old
            logger.exception("could not remove the pending marker %s", key)


def remove_leftovers(storage: Storage, min_age_s: float = LEFTOVER_AGE_S) -> list[str]:
    """Remove crash leftovers older than ``min_age_s``: scratch folders in the registry's
    tmp dir (and its ``uploads/``), the cache's temporary folders, the store's pieces."""
    removed: list[str] = []
    if storage.tmp_dir is not None:
        removed += remove_old(storage.tmp_dir / "uploads", min_age_s)
        removed += [n for n in remove_old(storage.tmp_dir, min_age_s) if n != "uploads"]
    removed += storage.cache.remove_leftovers(min_age_s)
    removed += storage.store.remove_leftovers(min_age_s)
    if removed:
        logger.info("removed %d crash leftovers: %s", len(removed), ", ".join(removed[:10]))
    return removed


def _pending(store: ObjectStore, digest: str | None = None) -> list:
    return list(store.list(PENDING_PREFIX + (f"{digest}/" if digest else "")))


def _referenced(storage: Storage, object_key: str) -> bool:
    with storage.db.session() as s:
        return s.scalar(select(AdapterVersion.id).where(AdapterVersion.object_key == object_key)
                        .limit(1)) is not None


def delete_if_unreferenced(storage: Storage, object_key: str) -> bool:
    """Delete one version's weights at once (called after the version's row is gone) unless
    a version still uses them or an upload of the same bytes is in progress; the cache
    entries of that content go too. Returns whether the object was deleted."""
    digest = object_key[len(OBJECT_PREFIX):].split("/")[0]
    stale_cutoff = datetime.now(timezone.utc) - timedelta(seconds=LEFTOVER_AGE_S)
    if _referenced(storage, object_key) or any(
            m.last_modified > stale_cutoff for m in _pending(storage.store, digest)):
        return False
    storage.store.delete(object_key)
    with storage.db.session() as s:
        configs = s.scalars(select(AdapterVersion.config).where(AdapterVersion.sha256 == digest))
        keep = {cache_entry_name(digest, c) for c in configs}
    for name in storage.cache.entries():
        if name.startswith(f"{digest}-") and name not in keep:
            storage.cache.remove(name)
    logger.info("removed the weights %s (no version uses them)", object_key)
    return True


def collect(storage: Storage, *, min_age_seconds: float = DEFAULT_GC_MIN_AGE_S,
            leftover_age_s: float = LEFTOVER_AGE_S) -> GcReport:
    """One gc pass (see the module doc)."""
    store, now = storage.store, datetime.now(timezone.utc)
    stale_cutoff = now - timedelta(seconds=leftover_age_s)
    cutoff = now - timedelta(seconds=min_age_seconds)
    live = {m.key.split("/")[1] for m in _pending(store) if m.last_modified > stale_cutoff}
    with storage.db.session() as s:
        referenced = set(s.scalars(select(AdapterVersion.object_key).distinct()))
    deleted = []
    for info in list(store.list(OBJECT_PREFIX)):
        digest = info.key[len(OBJECT_PREFIX):].split("/")[0]
        if info.key in referenced or digest in live or info.last_modified > cutoff:
            continue
        # again, just before deleting: an upload may have started (marker) or committed
        if any(m.last_modified > stale_cutoff for m in _pending(store, digest)):
            continue
        if _referenced(storage, info.key):
            continue
        store.delete(info.key)
        deleted.append(info.key)
    leftovers = []
    for marker in _pending(store):
        if marker.last_modified <= stale_cutoff:
            store.delete(marker.key)
            leftovers.append(marker.key)
    leftovers += remove_leftovers(storage, leftover_age_s)
    pruned = storage.cache.prune(_cache_entries_in_use(storage))
    if deleted or pruned or leftovers:
        logger.info("gc: deleted %d objects, pruned %d cache entries, removed %d leftovers",
                    len(deleted), len(pruned), len(leftovers))
    return GcReport(deleted, pruned, leftovers)


def _cache_entries_in_use(storage: Storage) -> set[str]:
    """The cache entry names of every retained version (weights and config)."""
    with storage.db.session() as s:
        rows = s.execute(select(AdapterVersion.sha256, AdapterVersion.config))
        return {cache_entry_name(sha, config) for sha, config in rows}
