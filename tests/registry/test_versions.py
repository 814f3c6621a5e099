"""Immutable versions, retention, rollouts and rollback in the registry, on every
database × store combination; nothing changes on a refused call."""

from __future__ import annotations

import pytest

from loramux.registry import AdapterNotFound, QuotaExceeded, Quotas
from loramux.registry.errors import (
    InvalidRollout,
    NoPreviousVersion,
    VersionInUse,
    VersionNotFound,
)
from loramux.registry.service import OBJECT_PREFIX


def objects(registry) -> set[str]:
    return {o.key for o in registry.store.list(OBJECT_PREFIX)}


def upload_versions(registry, make_adapter, n: int, name: str = "a", tenant: str = "acme"):
    return [registry.upload(tenant, name, make_adapter(f"{name}{i}", seed=100 + i))
            for i in range(n)]


def state(registry, name="a", tenant="acme"):
    release = registry.release(tenant, name)
    return sorted(release.versions), release.rollout


def test_retention_removes_the_oldest_unused_version_and_its_weights(registry, make_adapter):
    registry.create_tenant("acme")
    seen = []
    registry.subscribe(lambda kind, h: seen.append((kind, h.version)))
    handles = upload_versions(registry, make_adapter, 5)
    handles[0].local_path()  # in the local cache too
    assert state(registry)[0] == [1, 2, 3, 4, 5]
    sixth = registry.upload("acme", "a", make_adapter("a6", seed=7))
    assert sixth.version == 6
    versions, rollout = state(registry)
    assert versions == [2, 3, 4, 5, 6] and rollout.live == 6 and rollout.follow_latest
    assert handles[0].object_key not in objects(registry)  # the weights went at once
    assert handles[0].cache_key not in registry.cache.entries()
    assert {h.object_key for h in handles[1:]} | {sixth.object_key} == objects(registry)
    assert ("version_removed", 1) in seen
    [event] = [e for e in registry.events("acme") if e.kind == "version_removed"]
    assert event.details["version"] == 1 and event.details["reason"] == "retention"
    with pytest.raises(VersionNotFound):
        registry.get_version("acme", "a", 1)


def test_retention_keeps_weights_another_version_uses(registry, make_adapter):
    registry.create_tenant("acme")
    registry.set_quotas("acme", Quotas(max_versions_per_adapter=1))
    src = make_adapter("same")
    first = registry.upload("acme", "a", src)
    second = registry.upload("acme", "a", src)  # same bytes, new version
    assert second.version == 2 and state(registry)[0] == [2]
    assert objects(registry) == {first.object_key}  # still used by version 2


def test_retention_never_removes_rollout_versions(registry, make_adapter):
    registry.create_tenant("acme")
    registry.set_quotas("acme", Quotas(max_versions_per_adapter=2))
    upload_versions(registry, make_adapter, 2)
    registry.set_rollout("acme", "a", {"1": 50, "2": 50})
    before = state(registry), objects(registry), len(registry.events("acme"))
    with pytest.raises(QuotaExceeded, match="max_versions_per_adapter") as e:
        registry.upload("acme", "a", make_adapter("a3", seed=9))
    assert e.value.quota == "max_versions_per_adapter" and e.value.limit == 2
    assert state(registry) == before[0] and len(registry.events("acme")) == before[2]
    assert registry.gc(min_age_seconds=0).deleted_objects  # the refused upload's object
    assert objects(registry) == before[1]
    # a version out of the rollout may go: the previous live one last
    registry.set_rollout("acme", "a", {"2": 100})
    assert registry.upload("acme", "a", make_adapter("a3", seed=9)).version == 3
    assert state(registry)[0] == [2, 3]


def test_explicit_rollout_keeps_new_uploads_out_of_traffic(registry, make_adapter):
    registry.create_tenant("acme")
    upload_versions(registry, make_adapter, 1)
    registry.set_rollout("acme", "a", {"1": 100})
    registry.upload("acme", "a", make_adapter("a2", seed=5))
    versions, rollout = state(registry)
    assert versions == [1, 2] and rollout.weights == ((1, 100),) and not rollout.follow_latest
    release = registry.follow_latest("acme", "a")
    assert release.rollout.live == 2 and release.rollout.follow_latest
    assert release.rollout.rollback_to == 1


def test_rollouts_and_rollback(registry, make_adapter):
    registry.create_tenant("acme")
    seen = []
    registry.subscribe(lambda kind, h: seen.append(kind))
    upload_versions(registry, make_adapter, 1)
    with pytest.raises(NoPreviousVersion):
        registry.rollback("acme", "a")
    upload_versions(registry, make_adapter, 1)  # follows the latest: v2 takes over
    assert state(registry)[1].live == 2 and state(registry)[1].rollback_to == 1
    rollout = registry.rollback("acme", "a").rollout
    assert rollout.weights == ((1, 100),) and rollout.rollback_to == 2  # undo toggles
    assert registry.rollback("acme", "a").rollout.live == 2
    # a canary split: rollback drops the canary, the stable (older) version takes all
    rollout = registry.set_rollout("acme", "a", {"1": 90, "2": 10}, "key").rollout
    assert rollout.weights == ((1, 90), (2, 10)) and rollout.sticky == "key"
    assert rollout.rollback_to == 1
    rollout = registry.rollback("acme", "a").rollout
    assert rollout.weights == ((1, 100),) and rollout.sticky == "key"
    assert rollout.rollback_to == 2
    # promoted: rollback returns to the version live before the promotion
    registry.set_rollout("acme", "a", {"1": 30, "2": 70})
    assert registry.set_rollout("acme", "a", {"2": 100}).rollout.rollback_to == 1
    assert registry.rollback("acme", "a").rollout.live == 1
    kinds = [e.kind for e in registry.events("acme")]
    assert kinds.count("rolled_back") == 4 and kinds.count("rollout_changed") == 3
    assert [k for k in seen if k.startswith("roll")] == [
        "rolled_back", "rolled_back", "rollout_changed", "rolled_back", "rollout_changed",
        "rollout_changed", "rolled_back"]


def test_rollback_from_a_split_away_from_the_live_version(registry, make_adapter):
    registry.create_tenant("acme")
    upload_versions(registry, make_adapter, 3)
    registry.set_rollout("acme", "a", {"1": 100})
    assert registry.set_rollout("acme", "a", {"2": 50, "3": 50}).rollout.rollback_to == 1
    rollout = registry.rollback("acme", "a").rollout
    assert rollout.live == 1 and rollout.rollback_to is None  # back where it was
    with pytest.raises(NoPreviousVersion, match="no previous live version"):
        registry.rollback("acme", "a")


@pytest.mark.parametrize("weights, sticky, match", [
    ({"1": 90, "2": 20}, "user", "sum to 100"),  # refused by parse_weights
    ({"1": 90, "7": 10}, "user", "no version 7"),  # refused by the registry itself
    ({"1": 100}, "random", "sticky must be one of"),  # refused by check_sticky
])  # every other refusal of parse_weights / check_sticky: tests/registry/test_rollouts.py
def test_bad_rollouts_change_nothing(registry, make_adapter, weights, sticky, match):
    registry.create_tenant("acme")
    upload_versions(registry, make_adapter, 2)
    before = state(registry), len(registry.events("acme"))
    with pytest.raises(InvalidRollout, match=match):
        registry.set_rollout("acme", "a", weights, sticky)
    assert state(registry) == before[0] and len(registry.events("acme")) == before[1]


def test_deleting_versions(registry, make_adapter):
    registry.create_tenant("acme")
    handles = upload_versions(registry, make_adapter, 3)
    registry.set_rollout("acme", "a", {"2": 90, "3": 10})
    with pytest.raises(VersionInUse, match=r"in its rollout \(2: 90%, 3: 10%\)"):
        registry.delete_version("acme", "a", 3)
    with pytest.raises(VersionNotFound, match="no version 9"):
        registry.delete_version("acme", "a", 9)
    removed = registry.delete_version("acme", "a", 1)
    assert removed.version == 1 and state(registry)[0] == [2, 3]
    assert handles[0].object_key not in objects(registry)
    [event] = [e for e in registry.events("acme") if e.kind == "version_removed"]
    assert event.details["reason"] == "deleted"
    registry.follow_latest("acme", "a")  # the newest is in the (implicit) rollout
    with pytest.raises(VersionInUse, match="follows the latest"):
        registry.delete_version("acme", "a", 3)
    assert state(registry)[1].rollback_to == 2
    registry.delete_version("acme", "a", 2)  # the rollback target may go: it is cleared
    assert state(registry)[1].rollback_to is None
    assert registry.upload("acme", "a", make_adapter("a4", seed=44)).version == 4  # never reused


def test_another_tenants_adapter_is_not_found(registry, make_adapter):
    registry.create_tenant("acme")
    registry.create_tenant("globex")
    upload_versions(registry, make_adapter, 2)
    before = state(registry)
    for call in (lambda: registry.set_rollout("globex", "a", {"1": 100}),
                 lambda: registry.rollback("globex", "a"),
                 lambda: registry.follow_latest("globex", "a"),
                 lambda: registry.delete_version("globex", "a", 1),
                 lambda: registry.release("globex", "a")):
        with pytest.raises(AdapterNotFound, match="'a' not found"):
            call()
    assert state(registry) == before
