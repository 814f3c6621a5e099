"""An adapter's chat template is tenant input that runs: the render that checks it at upload
and PATCH is bounded. A template that loops for ever is killed at
``chat_template_render_timeout_s``, one that renders megabytes is refused, one that reaches
for Python internals or files is refused by the sandbox; each is a 422 that stores
nothing, while the neighbour's chat requests keep their latency and their greedy output."""

from __future__ import annotations

import time

import httpx
import pytest

TIMEOUT_S = 1.0
NESTED_LOOP = ("{% for a in range(100000) %}{% for b in range(100000) %}"
               "{% endfor %}{% endfor %}")
HUGE_OUTPUT = "{{ 'x' * 3000000 }}"  # past max_rendered_prompt_chars (2,000,000)
ESCAPES = [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "SecurityError"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "SecurityError"),
    ("{% include '/etc/passwd' %}", "no loader"),
]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _server(live):
    """A server with a short render limit, and the neighbour's canary turned into a greedy
    chat request whose text must not change (its latency bound stays the canary's)."""
    url, canary = live(chat_template_render_timeout_s=TIMEOUT_S)
    expected: list[str] = []

    def chat_once() -> float:
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", headers=_auth(canary.key), timeout=30,
                       json={"model": canary.model, "max_tokens": 4, "temperature": 0,
                             "messages": [{"role": "user", "content": "hello"}]})
        latency = time.monotonic() - start
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        expected.append(expected[0] if expected else text)
        assert text == expected[0], (text, expected[0])
        return latency

    canary.once = chat_once
    return url, canary.calibrate()


def _patch(url, tenants, template):
    return httpx.patch(f"{url}/v1/adapters/attacker-lora", headers=_auth(tenants.attacker_key),
                       json={"chat_template": template}, timeout=60)


def _refused(r, says: str) -> None:
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["code"] == "invalid_chat_template"
    assert says in err["message"], err["message"]


def _nothing_stored(url, tenants) -> None:
    r = httpx.get(f"{url}/v1/adapters/attacker-lora", headers=_auth(tenants.attacker_key),
                  timeout=30)
    assert r.json()["chat_template"] is None


@pytest.mark.latency
def test_looping_template_is_killed_at_the_limit_beside_the_neighbour(live, tenants):
    url, canary = _server(live)
    with canary.beside():
        start = time.monotonic()
        r = _patch(url, tenants, NESTED_LOOP)
        took = time.monotonic() - start
        files = [("file", (n, (tenants.adapter_dirs[2] / n).read_bytes()))
                 for n in ("adapter_config.json", "adapter_model.safetensors")]
        files.append(("file", ("chat_template.jinja", NESTED_LOOP.encode())))
        up = httpx.post(f"{url}/v1/adapters", headers=_auth(tenants.attacker_key),
                        data={"name": "looping"}, files=files, timeout=60)
    _refused(r, "chat_template_render_timeout_s")
    _refused(up, "chat_template_render_timeout_s")
    assert took < TIMEOUT_S + 5, took
    _nothing_stored(url, tenants)
    r = httpx.get(f"{url}/v1/adapters/looping", headers=_auth(tenants.attacker_key))
    assert r.status_code == 404


@pytest.mark.latency
def test_huge_output_is_refused_beside_the_neighbour(live, tenants):
    url, canary = _server(live)
    with canary.beside():
        r = _patch(url, tenants, HUGE_OUTPUT)
    _refused(r, "max_rendered_prompt_chars")
    _nothing_stored(url, tenants)


@pytest.mark.latency
@pytest.mark.parametrize("template, says", ESCAPES)
def test_sandbox_refuses_internals_and_files_beside_the_neighbour(live, tenants, template,
                                                                   says):
    url, canary = _server(live)
    with canary.beside():
        r = _patch(url, tenants, template)
    _refused(r, says)
    _nothing_stored(url, tenants)


@pytest.mark.latency
def test_a_flood_of_looping_templates_queues_behind_its_own_tenant(live, tenants):
    """Twelve looping PATCHes at once take the attacker twelve render limits; the neighbour's
    own template check waits for at most the one render ahead of it."""
    import concurrent.futures as cf

    url, canary = _server(live)
    tenants.registry.upload(tenants.neighbour.id, "neighbour-tpl", tenants.adapter_dirs[2])
    good = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with canary.beside(), cf.ThreadPoolExecutor(12) as pool:
        attacks = [pool.submit(_patch, url, tenants, NESTED_LOOP) for _ in range(12)]
        time.sleep(0.3)
        start = time.monotonic()
        mine = httpx.patch(f"{url}/v1/adapters/neighbour-tpl", timeout=60,
                           headers=_auth(tenants.neighbour_key), json={"chat_template": good})
        took = time.monotonic() - start
        results = [a.result(timeout=120) for a in attacks]
    assert mine.status_code == 200 and mine.json()["chat_template"] == good, mine.text
    assert took < TIMEOUT_S + 2, took  # without the per-tenant turn: 6 rounds of 1 s
    for r in results:
        _refused(r, "chat_template_render_timeout_s")
