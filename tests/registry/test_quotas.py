"""Per-tenant quotas: stored per tenant, defaults from the operator, storage quotas
enforced at upload — on every database × store combination."""

from __future__ import annotations

import threading

import pytest

from loramux.registry import InvalidQuota, QuotaExceeded, Quotas, TenantUsage
from loramux.registry.quotas import QUOTA_FIELDS


def test_quotas_validation():
    assert Quotas().to_dict() == {**dict.fromkeys(QUOTA_FIELDS), "max_versions_per_adapter": 5,
                                  "max_embedding_copy_bytes": 0}
    assert Quotas(max_adapters=0, max_stored_bytes=0).max_adapters == 0
    for field, bad in [
        ("requests_per_minute", 0),
        ("max_concurrent_requests", -1),
        ("tokens_per_minute", 1.5),
        ("max_queued_sequences", True),
        ("max_adapters", -1),
        ("max_stored_bytes", "10"),
        ("max_versions_per_adapter", 0),
        ("max_embedding_copy_bytes", -1),
        ("ttft_objective_ms", 0),
    ]:
        with pytest.raises(InvalidQuota, match=field):
            Quotas(**{field: bad})
    with pytest.raises(InvalidQuota, match="unknown quota 'rpm'"):
        Quotas.from_dict({"rpm": 5})
    q = Quotas(requests_per_minute=60, tokens_per_minute=10**10)
    assert Quotas.from_dict(q.to_dict()) == q


def test_get_set_reset_with_defaults(registry):
    defaults = Quotas(requests_per_minute=600, max_adapters=50)
    registry.default_quotas = defaults
    registry.create_tenant("acme")
    registry.create_tenant("globex")
    assert registry.get_quotas("acme") == defaults
    own = Quotas(max_concurrent_requests=4, max_queued_sequences=64, tokens_per_minute=10**10,
                 max_stored_bytes=2**40)
    assert registry.set_quotas("acme", own) == own
    assert registry.get_quotas("acme") == own  # None fields are unlimited, not defaults
    assert registry.get_quotas("globex") == defaults
    changed = Quotas(**{**own.to_dict(), "max_concurrent_requests": 8})
    registry.set_quotas("acme", changed)
    assert registry.get_quotas("acme").max_concurrent_requests == 8
    assert registry.set_quotas("acme", None) == defaults
    assert registry.get_quotas("acme") == defaults


def test_adapter_count_quota(registry, make_adapter):
    registry.create_tenant("acme")
    registry.create_tenant("globex")
    registry.set_quotas("acme", Quotas(max_adapters=2))
    src = make_adapter()
    registry.upload("acme", "one", src)
    registry.upload("acme", "two", src)
    with pytest.raises(QuotaExceeded, match=r"max_adapters exceeded.* 2 adapters of 2") as e:
        registry.upload("acme", "three", src)
    assert (e.value.quota, e.value.limit, e.value.current, e.value.requested) == (
        "max_adapters", 2, 2, 1)
    registry.upload("acme", "two", src)  # a new version adds no adapter
    registry.upload("globex", "three", src)  # another tenant is not affected
    registry.delete("acme", "one")
    registry.upload("acme", "three", src)
    assert registry.get_usage("acme").adapters == 2


def test_stored_bytes_quota(registry, make_adapter):
    registry.create_tenant("acme")
    small, big = make_adapter("small", r=2), make_adapter("big", r=8)
    size_small = registry.upload("acme", "a", small).size_bytes
    usage = registry.get_usage("acme")
    assert usage == TenantUsage(1, size_small)
    size_big = (big / "adapter_model.safetensors").stat().st_size
    registry.set_quotas("acme", Quotas(max_stored_bytes=size_small + size_big - 1))
    with pytest.raises(QuotaExceeded, match="max_stored_bytes") as e:
        registry.upload("acme", "b", big)
    assert (e.value.current, e.value.requested) == (size_small, size_big)
    assert registry.get_usage("acme") == usage  # nothing committed
    with pytest.raises(QuotaExceeded, match="max_stored_bytes"):  # a version is charged too
        registry.upload("acme", "a", big)
    assert registry.release("acme", "a").versions.keys() == {1}
    # the same bytes again are one stored object: a second version of them costs nothing
    assert registry.upload("acme", "a", small).version == 2
    assert registry.get_usage("acme") == TenantUsage(1, size_small)
    # retention makes room: with one version kept, the old one's bytes are freed
    registry.set_quotas("acme", Quotas(max_stored_bytes=size_big, max_versions_per_adapter=1))
    assert registry.upload("acme", "a", big).version == 3
    assert registry.get_usage("acme") == TenantUsage(1, size_big)
    registry.set_quotas("acme", Quotas(max_adapters=0))
    with pytest.raises(QuotaExceeded, match="max_adapters"):
        registry.upload("acme", "c", small)


def test_concurrent_uploads_respect_the_quota(registry, make_adapter):
    """Racing uploads of one tenant cannot both pass the check."""
    registry.create_tenant("acme")
    registry.set_quotas("acme", Quotas(max_adapters=1))
    sources = [make_adapter(f"s{i}", seed=i) for i in range(4)]
    outcomes: list[object] = []

    def upload(i: int) -> None:
        try:
            outcomes.append(registry.upload("acme", f"n{i}", sources[i]))
        except QuotaExceeded as e:
            outcomes.append(e)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(not isinstance(o, Exception) for o in outcomes) == 1, outcomes
    assert all(isinstance(o, QuotaExceeded) or hasattr(o, "sha256") for o in outcomes)
    assert registry.get_usage("acme").adapters == 1
