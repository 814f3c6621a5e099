"""64 concurrent streaming requests over 8 adapters and the base model all finish, and
each greedy output equals the same request made alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.adapters import write_random_adapter
from support.server import make_engine, make_registry, serve_in_thread

from loramux.platform.app import create_app
from loramux.platform.settings import Settings
from loramux.platform.state import close_state

BASE = "tiny-base"
ADAPTERS = [f"lora-{i}" for i in range(8)]
TIE = 1e-4


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("concurrency")
    # Fewer device slots than adapters: slots churn while requests run.
    engine = make_engine(tiny_model_dir, max_model_len=256, max_num_seqs=32, max_loras=4,
                         max_cpu_loras=8, max_waiting=256)
    registry = make_registry(root / "registry", tiny_model_dir)
    tenant, key = registry.create_tenant("load")
    for i, name in enumerate(ADAPTERS):
        registry.upload(tenant.id, name,
                        write_random_adapter(tiny_model_dir, root / name, seed=100 + i, std=0.3))
    app = create_app(Settings(served_model_name=[BASE]), engine=engine, registry=registry)
    with serve_in_thread(app) as url:
        yield url, key, engine
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()


def _body(i: int) -> dict:
    model = BASE if i % 9 == 8 else ADAPTERS[i % 9 % 8]
    return {"model": model, "prompt": f"Request {i}: the story of number {i * 7} begins",
            "max_tokens": 12 + i % 5, "temperature": 0, "logprobs": 1}


async def _stream(client: httpx.AsyncClient, body: dict) -> tuple[list[str], list[dict]]:
    tokens: list[str] = []
    tops: list[dict] = []
    import json

    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["logprobs"]:
                tokens += choice["logprobs"]["tokens"]
                tops += choice["logprobs"]["top_logprobs"]
        assert done
    return tokens, tops


def _same_or_tie(batched, alone) -> bool:
    """Equal token sequences, or they part ways only where the top two logits tie."""
    (tb, lb), (ta, la) = batched, alone
    for k, (x, y) in enumerate(zip(tb, ta, strict=False)):
        if x != y:
            gaps = [abs(lb[k].get(x, -1e9) - lb[k].get(y, -1e9)) if y in lb[k] else None,
                    abs(la[k].get(x, -1e9) - la[k].get(y, -1e9)) if x in la[k] else None]
            return any(g is not None and g < TIE for g in gaps)
    return len(tb) == len(ta)


def test_64_concurrent_streams_over_8_adapters(server):
    url, key, engine = server
    headers = {"Authorization": f"Bearer {key}"}

    async def run():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120, limits=limits) as c:
            batched = await asyncio.gather(*(_stream(c, _body(i)) for i in range(64)))
            alone = [await _stream(c, _body(i)) for i in range(64)]
        return batched, alone

    batched, alone = asyncio.run(run())
    assert all(len(t) == _body(i)["max_tokens"] for i, (t, _) in enumerate(batched))
    mismatched = [i for i in range(64) if not _same_or_tie(batched[i], alone[i])]
    assert not mismatched, [("".join(batched[i][0]), "".join(alone[i][0])) for i in mismatched]
    exact = sum(batched[i][0] == alone[i][0] for i in range(64))
    assert exact >= 60, exact
    # adapters really differ from the base model
    texts = {_body(i)["model"]: "".join(alone[i][0]) for i in range(9)}
    assert len(set(texts.values())) == 9
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
