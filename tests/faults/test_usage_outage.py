"""Usage records survive a database outage: a live server (uvicorn, real HTTP) over its own
PostgreSQL subprocess serves base-model traffic (cached key and quotas) while PostgreSQL is
killed -9 and, later, stalled (SIGSTOP); the records spill to the local file and are
replayed once it is back. Afterwards the ledger holds one record per answered request,
their tokens equal the ``usage`` objects the clients received, and nothing was dropped."""

from __future__ import annotations

import concurrent.futures as cf
import json
import shutil
import subprocess
import threading
import time

import httpx
import pytest
from sqlalchemy import func, select
from support.faults import postgres_service
from support.platform_settings import BASE, settings
from support.server import make_engine, serve_in_thread
from support.services import require_service

from loramux.platform.app import create_app
from loramux.platform.builders import open_registry
from loramux.platform.state import close_state
from loramux.registry.models import UsageRecord

pytestmark = pytest.mark.timeout(240)

BUDGETS = dict(db_call_timeout=1.0, db_connect_timeout=1.0, db_statement_timeout=1.0,
               db_pool_timeout=1.0, breaker_reset=1.0, model_cache_ttl=0.5,
               quota_cache_ttl=0.5, usage_retry_interval=0.5, usage_flush_interval=0.2,
               usage_write_timeout=1.0)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("usage-outage")
    try:
        pg, pg_url, pg_root = postgres_service()
        pg.start()
    except (FileNotFoundError, subprocess.CalledProcessError, TimeoutError, OSError) as e:
        require_service(False, f"a PostgreSQL subprocess ({e})")
    s = settings(database_url=pg_url, data_dir=root / "data", **BUDGETS)
    registry = open_registry(s, tiny_model_dir, auto_upgrade=True)
    _, key = registry.create_tenant("acme")
    engine = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=16, max_loras=2)
    app = create_app(s, engine=engine, registry=registry)
    with serve_in_thread(app) as url:
        yield dict(pg=pg, url=url, registry=registry, key=key, app=app, root=root)
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()
    pg.kill()
    pg.log.unlink(missing_ok=True)
    shutil.rmtree(pg_root, ignore_errors=True)


def _request(url: str, key: str, i: int) -> dict | None:
    """One request; the usage object the client received (None when it was refused)."""
    stream = i % 2 == 1
    body = {"model": BASE, "max_tokens": 2 + i % 3, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"request {i}"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    if not stream:
        return r.json()["usage"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    return chunks[-1]["usage"]


def _traffic(url: str, key: str, stop: threading.Event) -> list[dict]:
    got: list[dict] = []
    with cf.ThreadPoolExecutor(4) as pool:
        i = 0
        while not stop.is_set():
            futures = [pool.submit(_request, url, key, i + j) for j in range(4)]
            i += 4
            got += [u for u in (f.result() for f in futures) if u is not None]
    return got


def _ledger(registry) -> tuple[int, int, int]:
    with registry.db.session() as s:
        n, prompt, completion = s.execute(
            select(func.count(), func.sum(UsageRecord.prompt_tokens),
                   func.sum(UsageRecord.completion_tokens)).where(UsageRecord.error.is_(None))
        ).one()
    return int(n), int(prompt or 0), int(completion or 0)


def _metric(url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    from support.platform_settings import ADMIN_KEY

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                     timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_no_usage_record_is_lost_while_postgresql_is_down(stack, fault):
    url, key, pg, registry = stack["url"], stack["key"], stack["pg"], stack["registry"]
    assert _request(url, key, 0) is not None  # the key and quotas are cached from here on
    r = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200  # it flushes the writer: the warm-up's record is in
    before = _ledger(registry)
    spilled = _metric(url, "loramux_usage_records_spilled_total")
    stop = threading.Event()
    with cf.ThreadPoolExecutor(1) as runner:
        traffic = runner.submit(_traffic, url, key, stop)
        time.sleep(1.0)
        if fault == "kill":
            pg.kill()
        else:
            pg.stall()
        time.sleep(4.0)  # requests keep being answered; their records spill
        deadline = time.monotonic() + 30  # a loaded machine may take longer to time out
        while (during := _metric(url, "loramux_usage_records_spilled_total") - spilled) == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if fault == "kill":
            pg.start()
        else:
            pg.resume()
        time.sleep(1.5)
        stop.set()
        got = traffic.result(timeout=60)
    assert during > 0, "the outage did not spill anything: the test proves nothing"
    want = (len(got), sum(u["prompt_tokens"] for u in got),
            sum(u["completion_tokens"] for u in got))
    deadline = time.monotonic() + 30
    while True:  # the writer replays the spill once PostgreSQL answers again
        try:
            now = _ledger(registry)
        except Exception:
            now = None
        if now is not None and tuple(a - b for a, b in zip(now, before, strict=True)) == want:
            break
        assert time.monotonic() < deadline, (now, before, want)
        time.sleep(0.3)
    assert len(got) > 20
    assert _metric(url, "loramux_usage_records_dropped_total") == 0
    assert _metric(url, "loramux_usage_records_pending", where="spill") == 0
    r = httpx.get(f"{url}/v1/usage", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["errors"] == 0
