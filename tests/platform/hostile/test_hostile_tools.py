"""Tools are tenant input: a flood of streamed tool calls with long arguments (every step
re-parsed), too many tools and a grammar too large to compile are bounded, beside the
neighbour's canary (its latency asserted, its greedy output unchanged)."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from support.forced_text import regex_literal

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
LONG_CALL = ('<tool_call>{"name": "get_weather", "arguments": {"city": "' + "ab" * 40
             + '"}}</tool_call>') * 2


def _canary_text(url: str, key: str) -> str:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "neighbour-lora", "prompt": "the canary says", "max_tokens": 8,
                         "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stream_calls(url: str, key: str) -> tuple[int, int]:
    """(status, tool-call chunks) of one streamed request whose text is forced to two long
    hermes calls."""
    chunks = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": "attacker-lora", "stream": True, "tools": [WEATHER],
                            "messages": [{"role": "user", "content": "go"}], "max_tokens": 200,
                            "structured_outputs": {"regex": regex_literal(LONG_CALL)}}) as r:
        for line in r.iter_lines():
            chunks += '"tool_calls"' in line
        return r.status_code, chunks


@pytest.mark.latency
def test_streamed_call_flood_keeps_the_neighbour(live, tenants):
    url, canary = live(enable_auto_tool_choice=True, tool_call_parser="hermes")
    before = _canary_text(url, tenants.neighbour_key)
    with concurrent.futures.ThreadPoolExecutor(4) as pool, canary.beside():
        results = list(pool.map(lambda _: _stream_calls(url, tenants.attacker_key), range(4)))
    assert all(status == 200 and chunks >= 2 for status, chunks in results), results
    assert _canary_text(url, tenants.neighbour_key) == before


def test_too_many_tools_and_a_huge_grammar_are_refused(live, tenants):
    url, canary = live(enable_auto_tool_choice=True, tool_call_parser="hermes", max_tools=4)
    headers = {"Authorization": f"Bearer {tenants.attacker_key}"}
    body = {"model": "attacker-lora", "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 4}
    with canary.beside():
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60,
                       json={**body, "tools": [WEATHER] * 5})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
        huge = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "a" * 50}
                                             for i in range(2000)}}}}
        r = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=60,
                       json={**body, "tools": [huge], "tool_choice": "required"})
        assert r.status_code == 400, r.text
        assert "max_grammar_chars" in r.json()["error"]["message"]
