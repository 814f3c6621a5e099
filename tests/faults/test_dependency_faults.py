"""The fault suite: a live server (uvicorn, real HTTP) over its own PostgreSQL, S3 server
(moto_server) and Redis, each stalled with SIGSTOP and killed while requests flow.

For every fault: the requests that do not need the failed dependency stay within 3x their
idle latency (plus 0.5 s of slack for a shared 2-core machine); the requests that need it
fail within their budget with 503 + Retry-After, no connection reset, no address, bucket
or key in the body; once the dependency is back everything works without a restart, and
the listing and the audit log are exactly what was committed. A process killed -9 in the
middle of an upload leaves nothing that the next gc does not remove."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

import httpx
import pytest
from support.adapters import write_random_adapter
from support.faults import moto_service, postgres_service, redis_service
from support.platform_settings import BASE, settings
from support.server import make_engine, serve_in_thread
from support.services import require_service

from loramux.platform.app import create_app
from loramux.platform.builders import open_registry
from loramux.platform.state import close_state
from loramux.registry.quotas import Quotas

BUDGETS = dict(db_call_timeout=1.0, store_call_timeout=2.0, db_connect_timeout=1.0,
               db_statement_timeout=1.0, db_pool_timeout=1.0, s3_connect_timeout=0.5,
               s3_read_timeout=1.0, s3_max_attempts=1, redis_socket_timeout=0.5,
               redis_connect_timeout=0.5, breaker_reset=1.0, model_cache_ttl=0.5)
SECRETS = ("127.0.0.1", "lmx-faults", "adapters/sha256", "postgresql")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    try:
        pg, pg_url, pg_root = postgres_service()
        services = {"pg": pg.start(), "s3": moto_service().start(),
                    "redis": redis_service().start()}
    except (FileNotFoundError, subprocess.CalledProcessError, TimeoutError, OSError) as e:
        require_service(False, f"PostgreSQL/redis-server/moto_server subprocesses ({e})")
    mp = pytest.MonkeyPatch()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        mp.setenv(k, "testing")
    s = settings(database_url=pg_url, s3_bucket="lmx-faults",
                 s3_endpoint_url=f"http://127.0.0.1:{services['s3'].port}",
                 redis_url=f"redis://127.0.0.1:{services['redis'].port}/0",
                 data_dir=root / "data", **BUDGETS)
    from loramux.registry.s3 import S3Store

    S3Store(s.s3_bucket, endpoint_url=s.s3_endpoint_url).create_bucket()
    registry = open_registry(s, tiny_model_dir, auto_upgrade=True)
    free, free_key = registry.create_tenant("free")
    limited, limited_key = registry.create_tenant("limited")
    registry.set_quotas(limited.id, Quotas(requests_per_minute=10_000))
    _, unseen_key = registry.create_tenant("unseen")  # its key is first used in an outage
    adapters = [write_random_adapter(tiny_model_dir, root / f"a{i}", seed=i, std=0.3)
                for i in range(3)]
    for i, name in enumerate(("hot", "cold", "cold2")):
        registry.upload(free.id, name, adapters[i])
    engine = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=16, max_loras=2,
                         max_cpu_loras=4)
    app = create_app(s, engine=engine, registry=registry)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield dict(services=services, client=client, registry=registry, adapters=adapters,
                   root=root, settings=s, model_dir=tiny_model_dir,
                   free={"Authorization": f"Bearer {free_key}"},
                   limited={"Authorization": f"Bearer {limited_key}"},
                   unseen={"Authorization": f"Bearer {unseen_key}"})
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()
    for svc in services.values():
        svc.kill()
        svc.log.unlink(missing_ok=True)
    shutil.rmtree(pg_root, ignore_errors=True)
    mp.undo()


def _complete(c, h, model=BASE):
    t0 = time.monotonic()
    r = c.post("/v1/completions", headers=h, json={"model": model, "prompt": "hi",
                                                    "max_tokens": 2, "temperature": 0})
    return r, time.monotonic() - t0


def _idle(c, h, model=BASE) -> float:
    times = []
    for _ in range(3):
        r, dt = _complete(c, h, model)
        assert r.status_code == 200, r.text
        times.append(dt)
    return statistics.median(times)


def _unavailable(r, code: str, budget: float, took: float) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == code
    assert int(r.headers["retry-after"]) >= 1
    assert took < budget, f"{took:.2f} s past the {budget} s budget"
    for secret in SECRETS:
        assert secret not in r.text


def _snapshot(registry, tenant="free"):
    listing = [(h.name, h.version, h.sha256) for h in registry.list(tenant)]
    audit = [(e.kind, e.adapter_name) for e in registry.events(tenant, limit=1000)]
    return listing, audit


@pytest.mark.latency
def test_stalled_and_killed_store(stack):
    c, h = stack["client"], stack["free"]
    s3 = stack["services"]["s3"]
    stack["registry"].cache.prune(keep=())  # cold adapters come from the store
    idle_base, idle_hot = _idle(c, h), _idle(c, h, "hot")  # hot: fetched once, resident
    before = _snapshot(stack["registry"])
    s3.stall()
    try:
        r, took = _complete(c, h, "cold")
        _unavailable(r, "object_store_unavailable", 2.0 + 1.0, took)
        print(f"S3 stalled: cold adapter 503 in {took:.2f} s")
        for model, idle in ((BASE, idle_base), ("hot", idle_hot)):
            r, took = _complete(c, h, model)
            assert r.status_code == 200 and took < 3 * idle + 0.5, (model, took, idle)
            print(f"S3 stalled: {model} {took * 1000:.0f} ms (idle {idle * 1000:.0f} ms)")
        assert c.get("/v1/adapters", headers=h).status_code == 200
        ready = c.get("/ready")
        assert ready.status_code == 200 and ready.json()["dependencies"]["object store"] == "down"
    finally:
        s3.resume()
    time.sleep(1.1)  # the breaker's reset
    r, _ = _complete(c, h, "cold")
    assert r.status_code == 200, r.text
    s3.kill()
    r, took = _complete(c, h, "cold2")
    _unavailable(r, "object_store_unavailable", 2.0, took)
    s3.start()  # moto keeps objects in memory: a killed one comes back empty
    assert _snapshot(stack["registry"]) == before


@pytest.mark.latency
def test_stalled_and_killed_database(stack):
    c, h, reg = stack["client"], stack["free"], stack["registry"]
    pg = stack["services"]["pg"]
    idle = _idle(c, h)
    assert _complete(c, h, "hot")[0].status_code == 200
    before = _snapshot(reg)
    time.sleep(0.6)  # past model_cache_ttl: the resolutions are stale now
    pg.stall()
    try:
        r, took = _complete(c, h)  # a cached key: served stale, no database call
        assert r.status_code == 200 and took < 3 * idle + 0.5, (took, idle)
        print(f"PostgreSQL stalled: base model {took * 1000:.0f} ms (idle {idle * 1000:.0f} ms)")
        r, took = _complete(c, h, "hot")  # a cached resolution, a resident adapter
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        r = c.get("/v1/adapters", headers=h)
        _unavailable(r, "database_unavailable", 1.0 + 1.0, time.monotonic() - t0)
        print(f"PostgreSQL stalled: GET /v1/adapters 503 in {time.monotonic() - t0:.2f} s")
        t0 = time.monotonic()
        r = c.post("/v1/completions", headers=stack["unseen"],
                   json={"model": BASE, "prompt": "x", "max_tokens": 1})
        _unavailable(r, "database_unavailable", 1.0 + 1.0, time.monotonic() - t0)
        t0 = time.monotonic()
        ready = c.get("/ready")
        assert time.monotonic() - t0 < 2.0 and ready.json()["dependencies"]["database"] == "down"
    finally:
        pg.resume()
    time.sleep(1.1)
    assert c.get("/v1/adapters", headers=h).status_code == 200
    assert _snapshot(reg) == before
    pg.kill()  # a crash: connections reset, the next ones refused
    t0 = time.monotonic()
    r = c.get("/v1/adapters", headers=h)
    _unavailable(r, "database_unavailable", 2.0, time.monotonic() - t0)
    assert _complete(c, h)[0].status_code == 200
    pg.start()  # recovery from the same data folder
    time.sleep(1.1)
    deadline = time.monotonic() + 10
    while c.get("/v1/adapters", headers=h).status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert c.get("/v1/adapters", headers=h).status_code == 200  # no restart of loramux
    assert _snapshot(reg) == before  # nothing lost, nothing half-made


@pytest.mark.latency
def test_stalled_and_killed_redis(stack):
    c, lim, free = stack["client"], stack["limited"], stack["free"]
    redis = stack["services"]["redis"]
    assert _complete(c, lim)[0].status_code == 200
    idle = _idle(c, free)
    redis.stall()
    try:
        r, took = _complete(c, lim)
        _unavailable(r, "limiter_unavailable", 0.5 * 2 + 1.0, took)
        r, took = _complete(c, free)  # no quotas: no Redis call
        assert r.status_code == 200 and took < 3 * idle + 0.5
        assert c.get("/ready").json()["dependencies"]["redis"] == "down"
    finally:
        redis.resume()
    assert _complete(c, lim)[0].status_code == 200
    redis.kill()
    r, took = _complete(c, lim)
    _unavailable(r, "limiter_unavailable", 2.0, took)
    redis.start()
    deadline = time.monotonic() + 5
    while _complete(c, lim)[0].status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _complete(c, lim)[0].status_code == 200


def test_kill_9_mid_upload_leaves_nothing_after_gc(stack, tmp_path):
    """A CLI upload killed -9 while the store is stalled: its scratch folder and pending
    marker go at the next gc; the listing never shows the adapter."""
    from loramux.registry.s3 import S3Store

    reg, s3 = stack["registry"], stack["services"]["s3"]
    s = stack["settings"]
    S3Store(s.s3_bucket, endpoint_url=s.s3_endpoint_url).create_bucket()  # moto restarted
    before = _snapshot(reg)
    tmp = reg.tmp_dir

    def scratch():  # the archive unpacked, the pending marker's local file
        return [p for p in tmp.iterdir() if p.name.startswith(("loramux-adapter-", "pending-"))]

    archive = tmp_path / "doomed.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for f in stack["adapters"][2].iterdir():
            tar.add(f, arcname=f.name)
    code = (
        "import sys; from pathlib import Path\n"
        "from loramux.platform.builders import open_registry\nfrom loramux.platform.settings import Settings\n"
        f"s = Settings(**{json.dumps({k: str(v) for k, v in s.model_dump().items() if k in ('database_url', 's3_bucket', 's3_endpoint_url', 'data_dir')})})\n"
        f"r = open_registry(s, Path({str(stack['model_dir'])!r}), auto_upgrade=False)\n"
        "print('ready', flush=True)\n"
        f"r.upload('free', 'doomed', Path({str(archive)!r}), replace=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "AWS_ACCESS_KEY_ID": "testing",
                                 "AWS_SECRET_ACCESS_KEY": "testing"})
    try:
        assert proc.stdout.readline().strip() == "ready"
        s3.stall()  # the upload unpacks, validates, then waits on the store
        deadline = time.monotonic() + 20
        while not any(p.name.startswith("pending-") for p in scratch()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        proc.kill()
        proc.wait(10)
    finally:
        s3.resume()
    assert scratch()  # what kill -9 left
    report = reg.gc(leftover_age_s=0)
    assert not scratch()
    assert report.removed_leftovers
    assert _snapshot(reg) == before
