"""``usage.prompt_tokens_details.cached_tokens`` on completions and chat (streamed too), and an
activated LoRA's context before its invocation served from the base model's cached blocks."""

from __future__ import annotations

import json

from support.adapters import write_random_adapter
from support.platform_settings import BASE
from support.server import parse_sse

CTX = list(range(300, 340))  # 40 tokens: two full blocks of 16 before the invocation
INV = [500, 501, 502]


def _alora(env, tmp_path, name: str, invocation: list[int]) -> str:
    path = write_random_adapter(env.model_dir, tmp_path / name, seed=7, std=0.3)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = invocation
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    env.registry.upload(env.tenant_a.id, name, path)
    return name


async def _complete(client, env, model, prompt, **extra):
    r = await client.post("/v1/completions", headers=env.headers(env.key_a), json={
        "model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


async def test_alora_prompt_hits_the_base_models_blocks(client, env, tmp_path):
    name = _alora(env, tmp_path, "checker", INV)
    base = await _complete(client, env, BASE, CTX + [800, 801])
    assert base["prompt_tokens_details"] == {"cached_tokens": 0}
    used = await _complete(client, env, name, CTX + INV)
    assert used["prompt_tokens"] == 43
    assert used["prompt_tokens_details"] == {"cached_tokens": 32}  # the blocks before position 40
    other = _alora(env, tmp_path, "checker2", [600, 601])
    assert (await _complete(client, env, other, CTX + [600, 601]))["prompt_tokens_details"] == {
        "cached_tokens": 32}
    # a plain LoRA's blocks are its own: the base's are no use to it
    assert (await _complete(client, env, "a-only", CTX + [9]))["prompt_tokens_details"] == {
        "cached_tokens": 0}


async def test_chat_usage_counts_cached_tokens_streamed_or_not(client, env):
    body = {"model": BASE, "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": "You answer questions about the Roman Empire, briefly. " * 4},
        {"role": "user", "content": "Who was the first emperor?"}]}
    first = await client.post("/v1/chat/completions", headers=env.headers(env.key_a), json=body)
    assert first.status_code == 200, first.text
    again = await client.post("/v1/chat/completions", headers=env.headers(env.key_a), json=body)
    usage = again.json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < usage["prompt_tokens"]
    r = await client.post("/v1/chat/completions", headers=env.headers(env.key_a), json={
        **body, "stream": True, "stream_options": {"include_usage": True}})
    events = [e for e in parse_sse(r.text) if e != "[DONE]"]
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
