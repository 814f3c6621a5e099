"""Multi-process cluster on loopback: 2 gateways + 2 engines (tiny model), a private
``redis-server`` (this module kills it), a shared SQLite registry in one data dir.

Order matters: the rate limit runs before Redis is killed; failover kills an engine, so it
runs last.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from support.adapters import write_random_adapter
from support.server import free_port, parse_sse

from loramux.platform.cluster.redis_state import ClusterState
from loramux.platform.cluster.routing import rendezvous_order
from loramux.platform.identity import EngineKey

pytestmark = pytest.mark.timeout(300)

SECRET = "cluster-" + uuid.uuid4().hex
ADMIN = "admin-" + uuid.uuid4().hex
TTL = 1.5
ADAPTERS = ("alpha", "beta", "hot", "evictme", "doomed", "crash", "canary")
RPM = 3
"""The ``limited`` tenant's requests_per_minute (burst = RPM, then one per 60/RPM s)."""


def wait_for(pred, timeout=30.0, step=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(step)
    return pred()


class Cluster:
    def __init__(self, tmp: Path, model: Path, redis_url: str):
        self.tmp, self.model, self.redis_url = tmp, model, redis_url
        self.data = tmp / "data"
        self.ns = "lmx-" + uuid.uuid4().hex[:8]
        self.procs: dict[str, subprocess.Popen] = {}
        self.engines: dict[str, str] = {}  # engine id -> url
        self.gateways: list[str] = []
        self.keys: dict[str, str] = {}  # adapter name -> engine key

    def spawn(self, role: str, port: int, extra_env: dict | None = None) -> subprocess.Popen:
        exe = Path(sys.executable).parent / "loramux"
        args = [str(exe), "serve", "--role", role, "--port", str(port), "--host", "127.0.0.1",
                "--data-dir", str(self.data), "--redis-url", self.redis_url,
                "--redis-namespace", self.ns, "--cluster-secret", SECRET, "--admin-key", ADMIN,
                "--no-demo", "--heartbeat-interval", "0.2", "--heartbeat-ttl", str(TTL),
                "--log-level", "warning", "--log-format", "text"]
        if role == "engine":
            args += ["--model", str(self.model), "--device", "cpu", "--dtype", "float32",
                     "--max-loras", "2", "--max-num-seqs", "2", "--max-model-len", "512",
                     "--kv-cache-memory", str(16 * 2**20)]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
        log = open(self.tmp / f"{role}-{port}.log", "w")
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def state(self) -> ClusterState:
        return ClusterState(redis.Redis.from_url(self.redis_url, socket_timeout=1), self.ns)

    def residency(self) -> dict[str, set[str]]:
        return {r.engine_id: set(r.resident) for r in self.state().read_engines()}

    def ready(self, gw: str) -> dict:
        return httpx.get(f"{gw}/ready", timeout=5).json()

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir, module_private_redis):
    from loramux.registry import build_registry
    from loramux.registry.quotas import Quotas

    if not (Path(sys.executable).parent / "loramux").exists():
        pytest.fail("the loramux console script is not installed (run make install)")
    private = module_private_redis
    tmp = tmp_path_factory.mktemp("cluster")
    c = Cluster(tmp, tiny_model_dir, private.url)
    c.private = private
    reg = build_registry(data_dir=c.data, base_model=str(tiny_model_dir))
    tenant, c.key = reg.create_tenant("acme")
    limited, c.limited_key = reg.create_tenant("limited")
    reg.set_quotas(limited.id, Quotas(requests_per_minute=RPM))
    for i, name in enumerate(ADAPTERS):
        folder = write_random_adapter(tiny_model_dir, tmp / f"src-{name}", seed=i + 1)
        h = reg.upload(tenant.id, name, folder)
        c.keys[name] = str(EngineKey.for_handle(h))
    reg.db.dispose()
    try:
        for _ in range(2):
            port = free_port()
            c.procs[f"engine:{port}"] = c.spawn("engine", port)
        for _ in range(2):
            port = free_port()
            # a long resolve TTL: refusing a deleted adapter must come from the fan-out
            c.procs[f"gateway:{port}"] = c.spawn(
                "gateway", port, {"LORAMUX_MODEL_CACHE_TTL": "60",
                                  "LORAMUX_ROUTE_QUEUE_THRESHOLD": "0"})
            c.gateways.append(f"http://127.0.0.1:{port}")
        ok = wait_for(lambda: all(len(c.ready(g)["engines"]) == 2 for g in c.gateways), 150, 0.5)
        if not ok:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp.glob("*.log"))
            pytest.fail(f"the cluster did not come up:\n{logs}")
        c.engines = {r.engine_id: r.url for r in c.state().read_engines()}
        yield c
    finally:
        c.close()


def chat(c: Cluster, gw: str, model: str, *, max_tokens=8, stream=False, key=None,
         **kw) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": "hello there"}], **kw}
    return httpx.post(f"{gw}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key or c.key}"})


def test_engines_refuse_callers_without_the_cluster_secret(cluster):
    url = next(iter(cluster.engines.values()))
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "alpha", "messages": []},
                   headers={"Authorization": f"Bearer {cluster.key}"}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["code"] == "not_a_gateway"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_affinity_and_rendezvous_placement(cluster):
    for name in ("alpha", "beta"):
        home = rendezvous_order(cluster.keys[name], cluster.engines)[0]
        served = set()
        for i in range(4):
            r = chat(cluster, cluster.gateways[i % 2], name)
            assert r.status_code == 200, r.text
            served.add(r.headers["x-loramux-engine"])
        assert served == {home}, (name, served, home)
    metrics = httpx.get(f"{cluster.gateways[0]}/metrics", timeout=10).text
    assert 'loramux_gateway_requests_total{engine="' in metrics


def test_unknown_model_and_bad_key(cluster):
    r = chat(cluster, cluster.gateways[0], "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{cluster.gateways[0]}/v1/chat/completions", timeout=10,
                   json={"model": "alpha", "messages": []}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401


def test_spill_over_replicates_a_hot_adapter(cluster):
    gw = cluster.gateways[0]
    with cf.ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda _: chat(cluster, gw, "hot", max_tokens=48, ignore_eos=True),
                           range(8)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert {r.headers["x-loramux-engine"] for r in rs} == set(cluster.engines)
    key = cluster.keys["hot"]
    assert wait_for(lambda: all(key in res for res in cluster.residency().values()), 10)


def admin(c: Cluster, method: str, path: str, key: str = ADMIN, **kw) -> httpx.Response:
    return httpx.request(method, f"{c.gateways[1]}/admin{path}", timeout=60,
                         headers={"Authorization": f"Bearer {key}"}, **kw)


def gpu_engines(c: Cluster, key: str) -> set[str]:
    """The engines the gateway's dashboard shows ``key`` in a device slot on."""
    rows = admin(c, "GET", "/adapters").json()["data"]
    return {r["engine"] for r in rows if r["key"] == key and r["tier"] == "gpu"}


def test_gateway_dashboard_shows_and_acts_on_each_engine(cluster):
    a, b = sorted(cluster.engines)
    over = admin(cluster, "GET", "/overview")
    assert over.status_code == 200, over.text
    cards = {e["id"]: e for e in over.json()["engines"]}
    assert set(cards) == {a, b} and all(e["role"] == "engine" for e in cards.values())
    assert all(e["max_loras"] > 0 and e["lora_enabled"] for e in cards.values())
    key = cluster.keys["evictme"]
    r = admin(cluster, "POST", f"/adapters/{key}/warm", params={"engine": a})
    assert r.status_code == 200 and r.json()["done"] and r.json()["engines"] == [a], r.text
    assert wait_for(lambda: gpu_engines(cluster, key) == {a}, 10)  # residency on A only
    assert admin(cluster, "POST", f"/adapters/{key}/warm", params={"engine": b}).json()["done"]
    assert wait_for(lambda: gpu_engines(cluster, key) == {a, b}, 10)
    r = admin(cluster, "POST", f"/adapters/{key}/evict", params={"engine": a})
    assert r.status_code == 200 and r.json()["done"] and r.json()["engines"] == [a], r.text
    assert wait_for(lambda: gpu_engines(cluster, key) == {b}, 10)  # still on the other
    assert key in cluster.residency()[b]
    r = admin(cluster, "POST", f"/adapters/{key}/evict")  # fleet-wide
    assert r.status_code == 200 and sorted(r.json()["engines"]) == [a, b], r.text
    assert wait_for(lambda: not any(key in res for res in cluster.residency().values()), 10)
    assert gpu_engines(cluster, key) == set()
    r = admin(cluster, "POST", f"/adapters/{key}/evict", params={"engine": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "engine_not_found"
    assert admin(cluster, "POST", f"/adapters/{key}/evict", key=cluster.key).status_code == 403
    assert httpx.get(f"{cluster.gateways[1]}/admin/overview", timeout=10).status_code == 401


@pytest.mark.latency
def test_deleted_adapter_is_refused_by_every_gateway_at_once(cluster):
    for gw in cluster.gateways:  # both gateways have the resolution cached (TTL 60 s)
        assert chat(cluster, gw, "doomed").status_code == 200
    r = httpx.delete(f"{cluster.gateways[0]}/v1/adapters/doomed", timeout=30,
                     headers={"Authorization": f"Bearer {cluster.key}"})
    assert r.status_code in (200, 204), r.text
    t0 = time.monotonic()
    assert wait_for(lambda: all(chat(cluster, gw, "doomed").status_code == 404
                                for gw in cluster.gateways), 3.0, 0.05)
    assert time.monotonic() - t0 < 3.0


def test_tenant_over_its_rate_limit_gets_429_from_either_gateway(cluster):
    base = cluster.model.name
    gws = cluster.gateways
    for i in range(RPM):  # the burst, spread over both gateways: one bucket for the fleet
        r = chat(cluster, gws[i % 2], base, max_tokens=2, key=cluster.limited_key)
        assert r.status_code == 200, r.text
    for gw in gws:
        r = chat(cluster, gw, base, max_tokens=2, key=cluster.limited_key)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
        retry = int(r.headers["retry-after"])
        assert 1 <= retry <= 60 // RPM + 1  # the next token of the bucket
        assert "x-loramux-engine" not in r.headers  # refused at the gateway
    # another tenant (no quotas) is not limited
    assert chat(cluster, gws[1], base, max_tokens=2).status_code == 200


def test_redis_killed_gateways_route_on_and_say_degraded(cluster):
    cluster.private.kill()
    try:
        assert wait_for(lambda: all(cluster.ready(g)["status"] == "degraded"
                                    for g in cluster.gateways), 10)
        time.sleep(TTL + 0.5)  # past the heartbeat TTL: the last view is kept anyway
        for gw in cluster.gateways:
            ready = httpx.get(f"{gw}/ready", timeout=5)
            assert ready.status_code == 200 and len(ready.json()["engines"]) == 2
            r = chat(cluster, gw, "alpha")
            assert r.status_code == 200, r.text
    finally:
        cluster.private.start()
    assert wait_for(lambda: all(cluster.ready(g)["status"] == "ready"
                                and len(cluster.ready(g)["engines"]) == 2
                                for g in cluster.gateways), 15)


def _version(cluster: Cluster, gw: str, model: str, user: str | None = None) -> str:
    r = chat(cluster, gw, model, max_tokens=1, **({"user": user} if user else {}))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model  # the name the client sent
    return r.headers["x-loramux-adapter-version"]


def _agree_after(cluster: Cluster, want: str, model: str = "canary") -> float:
    """Seconds from now until a round of requests to both gateways at once (the round's
    start: what each answered was their state then) all served version ``want``."""
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(len(cluster.gateways)) as pool:
        while time.monotonic() - t0 < 10:
            started = time.monotonic()
            got = list(pool.map(lambda gw: _version(cluster, gw, model), cluster.gateways))
            if all(g == want for g in got):
                return started - t0
            time.sleep(0.02)
    return float("inf")


@pytest.mark.latency
def test_a_rollout_change_reaches_both_gateways_within_a_second(cluster, tmp_path):
    """Gateways choose the version (their resolutions are cached for 60 s: only the
    fan-out can move them) and pin it for the engine; both pick alike per user."""
    gws, h = cluster.gateways, {"Authorization": f"Bearer {cluster.key}"}
    channel = f"{cluster.ns}:events"  # every gateway and engine listens (again: Redis restarted)
    assert wait_for(lambda: cluster.state().client.pubsub_numsub(channel)[0][1] >= 4, 15)
    folder = write_random_adapter(cluster.model, tmp_path / "canary-v2", seed=77)
    files = [("file", (n, (folder / n).read_bytes()))
             for n in ("adapter_config.json", "adapter_model.safetensors")]
    for gw in gws:
        assert _version(cluster, gw, "canary") == "1"
    r = httpx.post(f"{gws[0]}/v1/adapters", headers=h, data={"name": "canary"}, files=files,
                   timeout=60)
    assert r.status_code == 201 and r.json()["version"] == 2, r.text
    # it follows the latest: v2 takes over on both gateways at once
    assert _agree_after(cluster, "2") < 1.0
    for weights, want in (({"1": 100}, "1"), ({"2": 100}, "2")):
        r = httpx.put(f"{gws[1]}/v1/adapters/canary/rollout", headers=h, timeout=30,
                      json={"weights": weights})
        assert r.status_code == 200, r.text
        assert _agree_after(cluster, want) < 1.0
    r = httpx.put(f"{gws[0]}/v1/adapters/canary/rollout", headers=h, timeout=30,
                  json={"weights": {"1": 50, "2": 50}, "sticky": "user"})
    assert r.status_code == 200, r.text
    time.sleep(0.5)
    seen = {}
    for i in range(12):
        picks = {_version(cluster, gw, "canary", user=f"user-{i}") for gw in gws}
        assert len(picks) == 1, (i, picks)  # one user, one version, whichever gateway
        seen[i] = picks.pop()
    assert set(seen.values()) == {"1", "2"}
    assert _version(cluster, gws[1], "canary@1") == "1"  # a pin wins over the split
    # a rollback drops the split: its oldest version takes everything, on both gateways
    r = httpx.post(f"{gws[1]}/v1/adapters/canary/rollback", headers=h, timeout=30)
    assert r.status_code == 200 and r.json()["weights"] == {"1": 100}, r.text
    assert wait_for(lambda: all(_version(cluster, gw, "canary", user=f"user-{i}") == "1"
                                for gw in gws for i in seen), 1.5, 0.02)


def test_failover_when_an_engine_dies(cluster):
    gw = cluster.gateways[0]
    victim = rendezvous_order(cluster.keys["crash"], cluster.engines)[0]
    port = victim.rsplit(":", 1)[1]
    proc = cluster.procs[f"engine:{port}"]
    body = {"model": "crash", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]}
    with httpx.Client(timeout=60) as client, cf.ThreadPoolExecutor(6) as pool:
        with client.stream("POST", f"{gw}/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {cluster.key}"}) as stream:
            assert stream.headers["x-loramux-engine"] == victim
            chunks = stream.iter_text()
            text = next(chunks)
            futs = [pool.submit(chat, cluster, gw, "crash", max_tokens=64, ignore_eos=True)
                    for _ in range(5)]
            time.sleep(0.3)
            proc.send_signal(signal.SIGKILL)
            text += "".join(chunks)
        rs = [f.result() for f in futs]
    events = parse_sse(text)
    assert events[-1] != "[DONE]" and events[-1]["error"]["code"] == "engine_lost"
    assert any(isinstance(e, dict) and e.get("choices") for e in events[:-1])
    for r in rs:  # every non-streaming request succeeded, once, with one answer
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 64
    assert wait_for(lambda: all(cluster.ready(g)["engines"] == [e for e in cluster.engines
                                                               if e != victim]
                                for g in cluster.gateways), TTL + 3)
    assert chat(cluster, gw, "crash").headers["x-loramux-engine"] != victim
