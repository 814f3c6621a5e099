"""The local cache is verified on use (a tampered copy is discarded and fetched again);
crash leftovers (scratch folders, temporary pieces, stale pending markers and their
orphans) go at the next start or gc; an orphan (stored, never committed) is found by its
missing pending marker after a short grace, while an upload in progress is left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

from loramux.registry.files import sha256_file
from loramux.registry.gc import OBJECT_PREFIX, PENDING_PREFIX, pending_marker

OLD = time.time() - 3600


def _age(path: Path) -> None:
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (OLD, OLD))


def test_tampered_cache_copy_is_replaced(registry, make_adapter):
    registry.create_tenant("acme")
    h = registry.upload("acme", "a", make_adapter())
    folder = h.local_path()
    weights = folder / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    weights.write_bytes(bytes(data))
    assert registry.cached_path(h) is None  # detected, discarded
    again = h.local_path()  # fetched again from the store
    assert sha256_file(again / "adapter_model.safetensors") == h.sha256
    assert registry.cached_path(h) == again
    # a copy touched but unchanged is hashed once, kept, and re-stamped
    os.utime(again / "adapter_model.safetensors")
    assert registry.cached_path(h) == again
    (again / "adapter_config.json").write_text('{"r": 64}')
    assert registry.cached_path(h) is None


def test_leftovers_of_a_killed_upload_go_at_start_and_gc(registry, make_adapter, tmp_path):
    from loramux.registry import build_registry

    registry.create_tenant("acme")
    tmp = registry.tmp_dir
    leftovers = [tmp / "uploads" / "upload-dead", tmp / "loramux-adapter-dead",
                 registry.cache.root / ".tmp-dead"]
    for d in leftovers:
        d.mkdir(parents=True)
        (d / "adapter_model.safetensors").write_bytes(b"x" * 1000)
        _age(d)
    # a process killed between the object write and the commit: marker + object, no row
    src = make_adapter()
    digest = sha256_file(src / "adapter_model.safetensors")
    key = f"{OBJECT_PREFIX}{digest}/adapter_model.safetensors"
    with pending_marker(registry.store, digest, tmp) as marker:
        registry.store.put_file(key, src / "adapter_model.safetensors", sha256=digest)
        # while the marker is fresh the object is an upload in progress
        assert registry.gc(min_age_seconds=0).deleted_objects == []
        report = registry.gc(min_age_seconds=0, leftover_age_s=0)  # now the marker is stale
        assert report.deleted_objects == [key] and marker in report.removed_leftovers
    assert not any(d.exists() for d in leftovers)
    # a restart removes old scratch folders and keeps one an upload is writing right now
    for d in leftovers:
        d.mkdir(parents=True, exist_ok=True)
        _age(d)
    fresh = tmp / "uploads" / "upload-live"
    fresh.mkdir(parents=True)
    (fresh / "part").write_bytes(b"y")
    build_registry(database_url=str(registry.db.url), data_dir=tmp_path / "data",
                   store=registry.store, auto_upgrade=False).db.dispose()
    assert not any(d.exists() for d in leftovers)
    assert fresh.exists()
    assert list(registry.store.list(PENDING_PREFIX)) == []


def test_orphan_without_marker_goes_after_the_short_grace(registry, make_adapter, monkeypatch):
    registry.create_tenant("acme")

    def boom(*_a, **_k):
        raise RuntimeError("killed before commit")

    monkeypatch.setattr(registry.uploads, "commit", boom)
    try:
        registry.upload("acme", "doomed", make_adapter())
    except RuntimeError:
        pass
    [orphan] = [o.key for o in registry.store.list(OBJECT_PREFIX)]
    assert list(registry.store.list(PENDING_PREFIX)) == []  # the failed upload's marker went
    assert registry.gc(min_age_seconds=0).deleted_objects == [orphan]
