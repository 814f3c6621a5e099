"""Usage records through a live server: the sums ``GET /v1/usage`` reports equal the
``usage`` objects the official ``openai`` client received over mixed streamed and
non-streamed traffic (chat and completions, ``n`` > 1, several prompts, base model and
adapter versions), per version and per key; one tenant never sees another's; the admin
sees all (JSON and CSV); per-version Prometheus series; bad queries are 400."""

from __future__ import annotations

import csv
import io
from collections import Counter
from datetime import datetime, timezone
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.adapters import write_random_adapter
from support.platform_settings import ADMIN_KEY, BASE, settings
from support.server import make_registry, serve_in_thread

from loramux.platform.app import create_app
from loramux.platform.state import close_state
from loramux.registry.auth import key_prefix

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def srv(engine, tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("usage")
    registry = make_registry(root / "registry", tiny_model_dir, max_lora_rank=16)
    acme, key = registry.create_tenant("acme")
    second_key = registry.create_api_key(acme.id, label="second")
    other, other_key = registry.create_tenant("other")
    for i in range(2):
        registry.upload(acme.id, "meter", write_random_adapter(tiny_model_dir, root / f"m{i}",
                                                              seed=60 + i, std=0.3))
    registry.upload(other.id, "theirs", write_random_adapter(tiny_model_dir, root / "t",
                                                             seed=70, std=0.3))
    app = create_app(settings(), engine=engine, registry=registry)
    with serve_in_thread(app) as url:
        yield SimpleNamespace(url=url, registry=registry, acme=acme, key=key,
                              second_key=second_key, other_key=other_key, app=app)
    close_state(app.services)
    registry.db.dispose()


def _usage(srv, key, **params) -> dict:
    r = httpx.get(f"{srv.url}/v1/usage", headers={"Authorization": f"Bearer {key}"},
                  params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _traffic(client: openai.OpenAI, key_label: str, sums: Counter) -> None:
    """Mixed requests whose usage the client receives; ``sums[(adapter, version, key,
    field)]`` adds it up (adapter None: the base model)."""
    def add(model, raw, usage):
        version = int(raw.headers.get("x-loramux-adapter-version", 0)) or None
        adapter = None if model == BASE else model.split("@")[0]
        for field in ("prompt_tokens", "completion_tokens"):
            sums[(adapter, version, key_label, field)] += getattr(usage, field)
        sums[(adapter, version, key_label, "requests")] += 1

    for model in (BASE, "meter", "meter@1", "meter@2"):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "count to three"}], max_tokens=5,
            temperature=0, n=2)
        add(model, raw, raw.parse().usage)
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "and now four"}], max_tokens=4,
            temperature=0.7, seed=3, stream=True, stream_options={"include_usage": True})
        usage = [c.usage for c in raw.parse() if c.usage is not None]
        assert len(usage) == 1
        add(model, raw, usage[0])
        raw = client.completions.with_raw_response.create(
            model=model, prompt=["one prompt", "and another one here"], max_tokens=3,
            temperature=0)
        add(model, raw, raw.parse().usage)
        raw = client.completions.with_raw_response.create(
            model=model, prompt="streamed", max_tokens=6, stream=True,
            stream_options={"include_usage": True})
        usage = [c.usage for c in raw.parse() if c.usage is not None]
        add(model, raw, usage[0])


def _fold(sums: Counter, keys: tuple[int, ...]) -> dict:
    out: dict = {}
    for k, v in sums.items():
        group = tuple(k[i] for i in keys)
        out.setdefault(group, Counter())[k[3]] += v
    return out


def test_usage_totals_equal_what_the_clients_received(srv):
    sums: Counter = Counter()
    labels = [key_prefix(srv.key), key_prefix(srv.second_key)]
    for key, label in zip((srv.key, srv.second_key), labels, strict=True):
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60)
        _traffic(client, label, sums)
    fields = ("requests", "prompt_tokens", "completion_tokens")
    [total] = _usage(srv, srv.key)["data"]
    assert {f: total[f] for f in fields} == {f: sum(v for k, v in sums.items() if k[3] == f)
                                             for f in fields}
    assert total["errors"] == 0
    assert total["total_tokens"] == total["prompt_tokens"] + total["completion_tokens"]
    rows = _usage(srv, srv.key, group_by="version")["data"]
    assert all(list(r)[:2] == ["adapter", "version"] for r in rows)
    got = {(r["adapter"], r["version"]): {f: r[f] for f in fields} for r in rows}
    want = {k: {f: c[f] for f in fields} for k, c in _fold(sums, (0, 1)).items()}
    assert got == want and set(got) == {(None, None), ("meter", 1), ("meter", 2)}
    got = {r["key"]: {f: r[f] for f in fields}
           for r in _usage(srv, srv.key, group_by="key")["data"]}
    assert got == {k[0]: {f: c[f] for f in fields} for k, c in _fold(sums, (2,)).items()}
    today = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    days = _usage(srv, srv.key, group_by=["day", "adapter"])["data"]
    assert {d["day"] for d in days} == {today}
    assert sum(d["requests"] for d in days) == total["requests"]
    # a stream whose client asked for no usage is recorded all the same
    r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {srv.key}"},
                   json={"model": "meter", "prompt": "x", "max_tokens": 7, "ignore_eos": True,
                         "stream": True}, timeout=60)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    [after] = _usage(srv, srv.key)["data"]
    assert after["requests"] == total["requests"] + 1
    assert after["completion_tokens"] == total["completion_tokens"] + 7


def test_usage_equals_the_clients_sums_exactly_with_include_usage(srv):
    """Only requests whose usage the client received: the ledger's sums are the clients'."""
    start = datetime.now(timezone.utc)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=srv.key, max_retries=0, timeout=60)
    got = Counter()
    for i, stream in enumerate((False, True) * 4):
        kwargs = dict(model="meter" if i % 3 else BASE, max_tokens=3 + i, temperature=0)
        if stream:
            chunks = client.chat.completions.create(
                messages=[{"role": "user", "content": f"stream {i}"}], stream=True,
                stream_options={"include_usage": True}, **kwargs)
            usage = [c.usage for c in chunks if c.usage is not None][0]
        else:
            usage = client.chat.completions.create(
                messages=[{"role": "user", "content": f"plain {i}"}], **kwargs).usage
        got["prompt_tokens"] += usage.prompt_tokens
        got["completion_tokens"] += usage.completion_tokens
        got["total_tokens"] += usage.total_tokens
    [row] = _usage(srv, srv.key, start=start.isoformat())["data"]
    assert row["requests"] == 8
    assert {k: row[k] for k in got} == dict(got)


def test_cached_prompt_tokens_are_recorded(srv):
    start = datetime.now(timezone.utc)
    prompt = "The same long prompt, repeated to hit the prefix cache. " * 8
    for _ in range(2):
        r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                       headers={"Authorization": f"Bearer {srv.key}"},
                       json={"model": BASE, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200
    [row] = _usage(srv, srv.key, start=start.isoformat())["data"]
    assert row["requests"] == 2 and 0 < row["cached_tokens"] < row["prompt_tokens"]


def test_tenants_see_only_their_own_usage(srv):
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {srv.other_key}"},
                   json={"model": "theirs", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    mine = _usage(srv, srv.other_key, group_by="adapter")["data"]
    assert [r["adapter"] for r in mine] == ["theirs"] and mine[0]["requests"] == 1
    assert "theirs" not in {r["adapter"] for r in _usage(srv, srv.key, group_by="adapter")["data"]}
    assert httpx.get(f"{srv.url}/v1/usage", timeout=10).status_code == 401
    r = httpx.get(f"{srv.url}/admin/usage", headers={"Authorization": f"Bearer {srv.key}"},
                  timeout=10)
    assert r.status_code == 403


def test_the_admin_sees_every_tenant_as_json_and_csv(srv):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    body = httpx.get(f"{srv.url}/admin/usage", headers=admin, timeout=30).json()
    by_tenant = {r["tenant"]: r for r in body["data"]}
    assert {"acme", "other"} <= set(by_tenant) and by_tenant["other"]["requests"] >= 1
    r = httpx.get(f"{srv.url}/admin/usage", params={"group_by": "tenant,adapter,version"},
                  headers={**admin, "Accept": "text/csv"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(r.text)))
    assert list(rows[0]) == ["tenant", "adapter", "version", "requests", "errors",
                             "prompt_tokens", "cached_tokens", "completion_tokens",
                             "total_tokens", "tenant_id"]
    assert {(x["tenant"], x["adapter"]) for x in rows} >= {("other", "theirs"), ("acme", "meter")}
    one = httpx.get(f"{srv.url}/admin/usage", params={"tenant": "other"}, headers=admin,
                    timeout=30).json()["data"]
    assert [x["tenant"] for x in one] == ["other"]
    r = httpx.get(f"{srv.url}/admin/usage", params={"tenant": "nobody"}, headers=admin, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"


@pytest.mark.parametrize("params, param", [
    ({"group_by": "tenant"}, "group_by"),
    ({"group_by": "adapter,nope"}, "group_by"),
    ({"start": "yesterday"}, "start"),
    ({"start": "2026-12-02", "end": "2026-12-01"}, "start"),
    ({"limit": "0"}, "limit"),
])
def test_bad_usage_queries_are_400(srv, params, param):
    r = httpx.get(f"{srv.url}/v1/usage", headers={"Authorization": f"Bearer {srv.key}"},
                  params=params, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_per_version_series_for_prometheus(srv):
    r = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                  timeout=30)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    requests = {(s.labels["adapter"], s.labels["version"]): s.value
                for s in families["loramux_adapter_version_requests"].samples
                if s.name.endswith("_total") and s.labels["status"] == "ok"}
    assert requests[("meter", "1")] >= 1 and requests[("meter", "2")] >= 1
    ttft = families["loramux_adapter_version_time_to_first_token_seconds"]
    assert any(s.labels.get("version") == "2" and s.name.endswith("_count") and s.value >= 1
               for s in ttft.samples)
    written = families["loramux_usage_records_written"].samples[0].value
    assert written >= 1
    dropped = {s.labels["reason"]: s.value for s in families["loramux_usage_records_dropped"].samples
               if s.name.endswith("_total")}
    assert set(dropped) == {"queue_full", "spill_full", "spill_failed", "refused"}
    assert not any(dropped.values())
