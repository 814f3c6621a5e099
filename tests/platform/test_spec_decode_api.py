"""A server with ``--speculative-config`` answers through a tenant's adapter exactly as
decoding without it does (plain and streamed, with logprobs), and /metrics counts the
adapter's drafted and accepted tokens."""

from __future__ import annotations

import json

import httpx
import pytest
from support.adapters import write_random_adapter
from support.platform_settings import ADMIN_KEY, settings
from support.server import make_engine, make_registry

from loramux.engine import LLM, LoRARequest, SamplingParams
from loramux.platform.app import create_app
from loramux.platform.state import close_state

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = "SELECT name FROM users WHERE id = 1; SELECT name FROM users WHERE id = 2; SELECT"


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    adapter = write_random_adapter(tiny_model_dir, tmp_path_factory.mktemp("a") / "sql", seed=3, std=0.3)
    engine = make_engine(tiny_model_dir, max_model_len=256, max_loras=2, speculative_config=SPEC)
    registry = make_registry(tmp_path_factory.mktemp("registry"), tiny_model_dir, max_lora_rank=16)
    _, key = registry.create_tenant("alpha")
    registry.upload(1, "sql", adapter)
    yield engine, registry, key, adapter
    registry.db.dispose()
    engine.shutdown()


@pytest.fixture
async def client(env):
    engine, registry, _, _ = env
    app = create_app(settings(), engine=engine, registry=registry)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                 timeout=60) as c:
        yield c
    close_state(app.services)


async def test_outputs_match_decoding_without_speculation_and_metrics_count(client, env, tiny_model_dir):
    _, _, key, adapter = env
    h = {"Authorization": f"Bearer {key}"}
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    r = await client.post("/v1/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    streamed, lps = "", []
    async with client.stream("POST", "/v1/completions", headers=h, json=body | {"stream": True}) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])["choices"][0]
                streamed += c["text"]
                lps += (c.get("logprobs") or {}).get("token_logprobs") or []
    ref = LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, enable_lora=True, max_loras=1)
    want = ref.generate(PROMPT, SamplingParams(temperature=0, max_tokens=40, logprobs=2, ignore_eos=True),
                        lora_request=LoRARequest("sql", 1, str(adapter)))[0].outputs[0]
    assert choice["text"] == streamed == want.text
    ref_lps = [lp[t].logprob for lp, t in zip(want.logprobs, want.token_ids, strict=True)]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref_lps, abs=1e-3)
    assert lps == pytest.approx(ref_lps, abs=1e-3)
    metrics = (await client.get("/metrics", headers=ADMIN)).text
    rows = [line for line in metrics.splitlines()
            if line.startswith("loramux_spec_decode_num_accepted_tokens{") and "/sql@" in line]
    assert rows and float(rows[0].rsplit(" ", 1)[1]) > 0, rows
