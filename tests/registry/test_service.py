"""RegistryService on every database × store combination."""

from __future__ import annotations

import threading

import pytest
import torch
from sqlalchemy import func, select

from loramux.adapters.format import load_adapter
from loramux.registry import (
    AdapterConflict,
    AdapterNotFound,
    InvalidPreset,
    ObjectIntegrityError,
    TenantConflict,
    TenantNotFound,
)
from loramux.registry.models import Adapter, AdapterEvent, ApiKey
from loramux.registry.service import OBJECT_PREFIX


def count_rows(registry, model=Adapter) -> int:
    with registry.db.session() as s:
        return s.scalar(select(func.count()).select_from(model))


def objects(registry) -> list[str]:
    return [o.key for o in registry.store.list(OBJECT_PREFIX)]


def test_upload_get_list_resolve_roundtrip(registry, make_adapter):
    registry.create_tenant("acme")
    src = make_adapter(r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    handle = registry.upload("acme", "sql-lora", src, actor="alice")
    assert (handle.name, handle.version, handle.rank, handle.status) == ("sql-lora", 1, 4, "ready")
    assert handle.target_modules == ("q_proj", "v_proj", "down_proj")
    assert handle.base_model == "tiny-llama" and len(handle.sha256) == 64
    assert handle.object_key == f"adapters/sha256/{handle.sha256}/adapter_model.safetensors"
    assert objects(registry) == [handle.object_key]

    assert registry.get("acme", "sql-lora") == handle
    assert [h.name for h in registry.list("acme")] == ["sql-lora"]
    release = registry.resolve("acme", "sql-lora")
    assert release.versions == {1: handle} and release.rollout.live == 1
    resolved = release.newest
    folder = resolved.local_path()
    assert (folder / "adapter_model.safetensors").read_bytes() == (
        src / "adapter_model.safetensors"
    ).read_bytes()
    assert resolved.local_path() == folder  # cached
    want, got = load_adapter(src), load_adapter(resolved.local_path())
    assert got.spec.scale == want.spec.scale
    for layer in want.layers:
        for module, (a, b) in want.layers[layer].items():
            assert torch.equal(got.layers[layer][module][0], a)
            assert torch.equal(got.layers[layer][module][1], b)
    assert registry.fetch_by_id(handle.id) == folder
    assert handle.to_dict()["target_modules"] == ["q_proj", "v_proj", "down_proj"]
    [event] = registry.events("acme")
    assert (event.kind, event.actor, event.adapter_name) == ("uploaded", "alice", "sql-lora")


def test_archive_upload(registry, make_adapter, tmp_path):
    import tarfile

    registry.create_tenant("acme")
    src = make_adapter()
    archive = tmp_path / "upload.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src, arcname="my-adapter")
    assert registry.upload("acme", "from-tar", archive).rank == 4


def test_tenant_isolation(registry, make_adapter):
    registry.create_tenant("acme")
    registry.create_tenant("globex")
    registry.upload("acme", "secret-sauce", make_adapter())
    with pytest.raises(AdapterNotFound) as theirs:
        registry.resolve("globex", "secret-sauce")
    with pytest.raises(AdapterNotFound) as missing:
        registry.resolve("globex", "no-such-adapter")
    assert str(theirs.value) == str(missing.value).replace("no-such-adapter", "secret-sauce")
    assert registry.list("globex") == []
    with pytest.raises(AdapterNotFound):
        registry.delete("globex", "secret-sauce")
    with pytest.raises(AdapterNotFound):
        registry.set_preset("globex", "secret-sauce", {"temperature": 0.0})
    # globex may use the same name for its own adapter
    registry.upload("globex", "secret-sauce", make_adapter("other", seed=1))
    assert (
        registry.get("acme", "secret-sauce").sha256 != registry.get("globex", "secret-sauce").sha256
    )


def test_unknown_tenant(registry, make_adapter):
    with pytest.raises(TenantNotFound, match="tenants create"):
        registry.upload("nobody", "x", make_adapter())
    with pytest.raises(TenantNotFound):
        registry.list("nobody")
    assert count_rows(registry) == 0 and objects(registry) == []


def test_uploads_add_versions(registry, make_adapter):
    registry.create_tenant("acme")
    first = registry.upload("acme", "a", make_adapter("one", seed=1))
    seen = []
    registry.subscribe(lambda kind, h: seen.append((kind, h.version)))
    second = registry.upload("acme", "a", make_adapter("two", seed=2))
    assert second.version == 2 and second.sha256 != first.sha256 and second.id == first.id
    assert second.cache_key != first.cache_key
    assert seen == [("version_added", 2)]
    assert registry.get("acme", "a") == second  # the newest
    old = registry.get_version("acme", "a", 1)  # the old one is kept, unchanged
    assert (old.sha256, old.cache_key, old.created_at) == (first.sha256, first.cache_key,
                                                           first.created_at)
    assert registry.gc(min_age_seconds=0).deleted_objects == []
    with pytest.raises(AdapterConflict, match="already exists"):
        registry.upload("acme", "a", make_adapter("three", seed=3), replace=False)
    assert registry.release("acme", "a").versions.keys() == {1, 2}
    assert [e.kind for e in registry.events("acme")] == ["version_added", "uploaded"]


def test_delete_gc_and_shared_objects(registry, make_adapter):
    registry.create_tenant("acme")
    registry.create_tenant("globex")
    src = make_adapter()
    a = registry.upload("acme", "same", src)
    b = registry.upload("globex", "same-bytes", src)
    assert a.object_key == b.object_key and len(objects(registry)) == 1
    a.local_path()
    registry.delete("acme", "same", actor="bob")
    assert [e.kind for e in registry.events("acme")] == ["deleted", "uploaded"]
    assert registry.gc(min_age_seconds=0).deleted_objects == []  # still used by globex
    registry.delete("globex", "same-bytes")
    report = registry.gc()
    assert report.deleted_objects == []  # within the grace period
    assert report.pruned_cache_entries == [a.cache_key]  # no adapter uses it any more
    report = registry.gc(min_age_seconds=0)
    assert report.deleted_objects == [a.object_key] and objects(registry) == []
    # the name is free again
    registry.upload("acme", "same", src)


def test_presets(registry, make_adapter):
    registry.create_tenant("acme")
    registry.upload("acme", "a", make_adapter(), default_preset={"temperature": 0.2})
    assert registry.get("acme", "a").default_preset == {"temperature": 0.2}
    h = registry.set_preset("acme", "a", {"temperature": 0, "max_tokens": 64, "stop": ";"})
    assert h.default_preset == {"temperature": 0.0, "max_tokens": 64, "stop": [";"]}
    for bad in (
        {"temprature": 1},
        {"top_p": 0},
        {"max_tokens": 1.5},
        {"stop": [1]},
        [1],
        {"n": True},
    ):
        with pytest.raises(InvalidPreset):
            registry.set_preset("acme", "a", bad)
    assert registry.set_preset("acme", "a", None).default_preset is None
    assert [e.kind for e in registry.events("acme", adapter_name="a")][:2] == [
        "preset_changed",
        "preset_changed",
    ]


def test_two_concurrent_uploads_of_one_name(registry, make_adapter, monkeypatch):
    registry.create_tenant("acme")
    sources = [make_adapter("one", seed=1), make_adapter("two", seed=2)]
    barrier = threading.Barrier(2, timeout=30)
    original = registry.uploads.commit

    def commit_together(*args, **kwargs):
        barrier.wait()  # both uploads passed the early check and stored their object
        return original(*args, **kwargs)

    monkeypatch.setattr(registry.uploads, "commit", commit_together)
    results: list[object] = [None, None]

    def run(i):
        try:
            results[i] = registry.upload("acme", "race", sources[i])
        except Exception as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(isinstance(r, Exception) for r in results), results
    assert sorted(r.version for r in results) == [1, 2]  # one adapter, two versions
    assert count_rows(registry) == 1
    assert registry.release("acme", "race").versions.keys() == {1, 2}
    assert sorted(objects(registry)) == sorted(r.object_key for r in results)


def test_failure_between_object_write_and_commit(registry, make_adapter, monkeypatch):
    registry.create_tenant("acme")

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure before commit")

    monkeypatch.setattr(registry.uploads, "commit", boom)
    with pytest.raises(RuntimeError, match="injected"):
        registry.upload("acme", "doomed", make_adapter())
    assert count_rows(registry) == 0 and count_rows(registry, AdapterEvent) == 0
    [orphan] = objects(registry)
    assert registry.gc().deleted_objects == []  # grace period protects in-flight uploads
    assert registry.gc(min_age_seconds=0).deleted_objects == [orphan]
    assert objects(registry) == []
    assert list((registry.tmp_dir).iterdir()) == []


def test_corrupt_object_is_refused_on_read(registry, make_adapter, tmp_path):
    registry.create_tenant("acme")
    h = registry.upload("acme", "a", make_adapter())
    bad = tmp_path / "bad"
    data = bytearray((make_adapter("copy") / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    # overwrite the stored object behind the registry's back (bypassing put_file's check)
    if hasattr(registry.store, "client"):
        registry.store.client.put_object(
            Bucket=registry.store.bucket,
            Key=registry.store._key(h.object_key),
            Body=bytes(data),
            Metadata={"sha256": h.sha256},
        )
    else:
        (registry.store.root / h.object_key).write_bytes(bytes(data))
    with pytest.raises(ObjectIntegrityError, match="corrupt"):
        h.local_path()
    assert registry.cache.entries() == []


def test_tenants_and_api_keys(registry):
    tenant, key = registry.create_tenant("acme")
    assert key.startswith("lmx_")
    with registry.db.session() as s:
        row = s.scalar(select(ApiKey))
        assert key not in row.key_hash and row.prefix in key and row.key_hash.startswith("pbkdf2")
    assert registry.authenticate(key).name == "acme"
    assert registry.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert registry.authenticate("lmx_000000000000_" + "x" * 43) is None
    assert registry.authenticate("garbage") is None
    assert registry.authenticate_key(key).is_admin is False
    admin_key = registry.create_api_key("acme", admin=True, label="ops")
    assert registry.authenticate_key(admin_key).is_admin is True
    assert registry.revoke_api_key(key) is True
    assert registry.authenticate(key) is None
    assert registry.revoke_api_key(key) is False
    with pytest.raises(TenantConflict):
        registry.create_tenant("acme")
    assert [t.name for t in registry.list_tenants()] == ["acme"]
    assert registry.get_tenant(tenant.id).name == "acme"
