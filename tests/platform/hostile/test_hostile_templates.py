"""Caller chat templates: refused unless the operator trusts them; when trusted, a
template that loops for ever neither freezes the event loop (``/health`` answers in
under 1 s while it runs) nor slows the neighbour, and it is stopped at the time limit."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest

NESTED_LOOP = ("{% for a in range(100000) %}{% for b in range(100000) %}"
               "{% endfor %}{% endfor %}")  # pure CPU: 10^10 iterations, no output
MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(url, key, **body):
    return httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "attacker-lora", "messages": MESSAGES, "max_tokens": 2,
                            **body}, timeout=30)


@pytest.mark.latency
def test_caller_template_refused_by_default(live, tenants):
    url, canary = live()
    with canary.beside():
        r = _chat(url, tenants.attacker_key, chat_template=NESTED_LOOP)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_trusted_template_renders_like_transformers(live, tenants, tiny_model_dir):
    from transformers import AutoTokenizer

    url, _ = live(trust_request_chat_template=True)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
    r = _chat(url, tenants.attacker_key, chat_template=template, max_tokens=1,
              temperature=0, prompt_logprobs=0)
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                   add_generation_prompt=True)
    assert r.json()["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False).input_ids)


@pytest.mark.latency
def test_trusted_nested_loop_template_keeps_health_and_neighbour(live, tenants):
    url, canary = live(trust_request_chat_template=True, chat_template_render_timeout_s=1.5)
    with concurrent.futures.ThreadPoolExecutor(1) as pool, canary.beside():
        start = time.monotonic()
        attack = pool.submit(_chat, url, tenants.attacker_key, chat_template=NESTED_LOOP)
        health = []
        while not attack.done() and time.monotonic() - start < 20:
            t = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=5).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)
        r = attack.result(timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "chat_template_render_timeout_s" in r.json()["error"]["message"]
    assert len(health) >= 5 and max(health) < 1.0, health
