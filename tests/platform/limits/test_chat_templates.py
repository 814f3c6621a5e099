"""Chat templates in killable worker processes: the same text as transformers'
``apply_chat_template``; a hostile template is stopped at the limit while the event loop
keeps answering; errors and oversized output are refused with the field named."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from transformers import AutoTokenizer

from loramux.platform.limits.request import RequestLimitError, RequestLimits
from loramux.platform.limits.templates import TemplateRenderer, template_variables

NESTED_LOOP = (
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}ok"
)
CONVERSATION = [
    {"role": "system", "content": "You write SQL."},
    {"role": "user", "content": "Names of all users older than 30?"},
    {"role": "assistant", "content": "SELECT name FROM users WHERE age > 30;"},
    {"role": "user", "content": "And sorted by name?"},
]


@pytest.fixture
async def renderer():
    r = TemplateRenderer(RequestLimits(chat_template_render_timeout_s=0.5,
                                       max_rendered_prompt_chars=10_000))
    yield r
    await r.aclose()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
async def test_same_text_as_transformers(renderer, tokenizer, add_generation_prompt):
    kwargs = {"custom_flag": "x"}
    want = tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    got = await renderer.render(
        tokenizer.chat_template, CONVERSATION, add_generation_prompt=add_generation_prompt,
        variables=template_variables(tokenizer, kwargs),
    )
    assert got == want
    caller = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    assert await renderer.render(caller, CONVERSATION[:1],
                                 variables=template_variables(tokenizer)) == (
        f"{tokenizer.bos_token or ''}[system]You write SQL."
    )


@pytest.mark.latency
async def test_nested_loop_is_killed_and_the_loop_stays_responsive(renderer):
    await renderer.render("warm {{ messages | length }}", CONVERSATION)  # worker started
    [worker] = renderer._idle
    lags: list[float] = []
    stop = asyncio.Event()

    async def canary():
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    task = asyncio.create_task(canary())
    t0 = time.perf_counter()
    with pytest.raises(RequestLimitError, match="longer than 0.5 s") as e:
        await renderer.render(NESTED_LOOP, CONVERSATION)
    took = time.perf_counter() - t0
    stop.set()
    await task
    assert e.value.param == "chat_template"
    assert 0.5 <= took < 2.0, took
    assert len(lags) > 20 and max(lags) < 0.2, max(lags)
    assert not worker.process.is_alive()  # the work really stopped
    assert renderer._idle == []
    assert await renderer.render("again", CONVERSATION) == "again"  # a fresh worker


async def test_template_errors_and_output_cap(renderer):
    with pytest.raises(RequestLimitError, match="TemplateError: roles must alternate") as e:
        await renderer.render("{{ raise_exception('roles must alternate') }}", CONVERSATION,
                              param="messages")
    assert e.value.param == "messages"
    with pytest.raises(RequestLimitError, match="TemplateSyntaxError"):
        await renderer.render("{% for %}", CONVERSATION)
    with pytest.raises(RequestLimitError, match="SecurityError"):  # the sandbox holds
        await renderer.render("{{ messages.__class__.__mro__ }}", CONVERSATION)
    with pytest.raises(RequestLimitError, match="10001 characters.*max_rendered_prompt_chars"):
        await renderer.render("{{ 'x' * 10001 }}", CONVERSATION)
    with pytest.raises(RequestLimitError, match="memory|stopped its worker"):
        await renderer.render("{{ ('x' * 2000000000) | length }}", CONVERSATION)
    assert await renderer.render("{{ messages[1].content }}", CONVERSATION) == CONVERSATION[1][
        "content"]


async def test_renders_run_side_by_side():
    r = TemplateRenderer(RequestLimits(chat_template_render_timeout_s=0.5), workers=2)
    try:
        slow = asyncio.create_task(r.render(NESTED_LOOP, CONVERSATION))
        await asyncio.sleep(0.05)
        assert await r.render("{{ 1 + 1 }}", CONVERSATION) == "2"  # not stuck behind it
        with pytest.raises(RequestLimitError):
            await slow
        pids = {w.process.pid for w in r._idle}
        assert os.getpid() not in pids
    finally:
        await r.aclose()
