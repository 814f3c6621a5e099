"""An adapter's own added tokens through the ``openai`` client against a live server: the
adapter uploaded to the registry (its tokens stored with it and read back from the engine's
cached folder) and the same folder as a static ``--lora-modules`` adapter (its tokenizer
files read as PEFT saved them). Its prompts count ``<tool>`` as one token and its outputs
(text, logprobs' tokens, streamed deltas, chat content) show the new tokens' text; the base
model's requests split ``<tool>`` and never show it."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest
from support.added_tokens import PROMPT, SEP, TOOL, add_tokens_adapter, make_tokens_adapter
from support.server import make_engine, make_registry, serve_in_thread

from loramux.adapters.added_tokens import STORED_KEY
from loramux.platform.app import create_app
from loramux.platform.settings import Settings
from loramux.platform.state import close_state

BASE = "tiny-padded"


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("openai-added-tokens")
    base, adapter, tok, base_tok = make_tokens_adapter(root, default_model_dir)
    engine = make_engine(base, max_model_len=128, max_num_seqs=8, max_loras=2)
    registry = make_registry(root / "registry", base)
    tenant, key = registry.create_tenant("acme")
    handle = registry.upload(tenant.id, "tools", adapter)
    thinker, _ = add_tokens_adapter(base, root / "thinker", [], ["<think>", "</think>"], seed=1)
    registry.upload(tenant.id, "thinker", thinker, reasoning_parser="qwen3")
    stored = handle.config[STORED_KEY]
    assert [(t["content"], t["id"], t.get("special", False)) for t in stored] == [
        (TOOL, len(base_tok), False), (SEP, len(base_tok) + 1, True)]
    settings = Settings(served_model_name=[BASE], lora_modules=[f"static-tools={adapter}"])
    app = create_app(settings, engine=engine, registry=registry)
    with serve_in_thread(app) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60), tok, base_tok, adapter
    close_state(app.services)
    engine.shutdown()
    registry.db.dispose()


def _bias(tok, token: str) -> dict:
    return {str(tok.convert_tokens_to_ids(token)): 100}


@pytest.mark.parametrize("model", ["tools", "static-tools"])
def test_completions_use_the_adapters_tokens(server, model):
    client, tok, base_tok, _ = server
    kwargs = dict(prompt=PROMPT, max_tokens=3, temperature=0, logit_bias=_bias(tok, TOOL), logprobs=1)
    mine = client.completions.create(model=model, **kwargs)
    assert mine.choices[0].text == TOOL * 3
    assert mine.choices[0].logprobs.tokens == [TOOL] * 3
    assert mine.usage.prompt_tokens == len(tok(PROMPT).input_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, stream=True, **kwargs) if c.choices)
    assert streamed == TOOL * 3
    echo = client.completions.create(model=model, echo=True, **{**kwargs, "logprobs": None})
    assert echo.choices[0].text == PROMPT + TOOL * 3
    base = client.completions.create(model=BASE, **kwargs)
    assert base.usage.prompt_tokens == len(base_tok(PROMPT).input_ids) > mine.usage.prompt_tokens
    assert TOOL not in base.choices[0].text and base.choices[0].text == ""


def test_chat_uses_the_adapters_tokens(server):
    client, tok, base_tok, _ = server
    messages = [{"role": "user", "content": PROMPT}]
    kwargs = dict(messages=messages, max_tokens=2, temperature=0)
    mine = client.chat.completions.create(model="tools", logit_bias=_bias(tok, TOOL), **kwargs)
    assert mine.choices[0].message.content == TOOL * 2
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert mine.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False).input_ids)
    base = client.chat.completions.create(model=BASE, logit_bias=_bias(tok, TOOL), **kwargs)
    assert base.usage.prompt_tokens == len(base_tok(rendered, add_special_tokens=False).input_ids)
    assert not base.choices[0].message.content
    # the special one: skipped unless asked for (vLLM's skip_special_tokens)
    sep = _bias(tok, SEP)
    out = client.chat.completions.create(model="tools", logit_bias=sep, **kwargs)
    assert out.choices[0].message.content == ""
    out = client.chat.completions.create(model="tools", logit_bias=sep, **kwargs,
                                         extra_body={"skip_special_tokens": False})
    assert out.choices[0].message.content == SEP * 2
    stream = client.chat.completions.create(model="tools", logit_bias=_bias(tok, TOOL),
                                            stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TOOL * 2


def _upload(client, name: str, folder, names) -> httpx.Response:
    files = [("file", (n, (folder / n).read_bytes())) for n in names]
    return httpx.post(f"{client.base_url}adapters", data={"name": name}, files=files, timeout=60,
                      headers={"Authorization": f"Bearer {client.api_key}"})


def test_http_upload_serves_or_refuses_the_tokens(server, tmp_path):
    """Through ``POST /v1/adapters`` (multipart): the tokenizer files reach the registry and
    the adapter's requests; an upload whose ``added_tokens.json`` leaves a gap is refused
    with 422 naming the token and the file."""
    client, tok, _, folder = server
    names = ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
             "tokenizer_config.json"]
    assert _upload(client, "tools-http", folder, names).status_code in (200, 201)
    out = client.completions.create(model="tools-http", prompt=PROMPT, max_tokens=2, temperature=0,
                                    logit_bias=_bias(tok, TOOL))
    assert out.choices[0].text == TOOL * 2
    assert out.usage.prompt_tokens == len(tok(PROMPT).input_ids)
    for n in names[:2]:
        shutil.copy(folder / n, tmp_path / n)
    gap = tok.convert_tokens_to_ids(TOOL) + 1
    (tmp_path / "added_tokens.json").write_text(json.dumps({TOOL: gap}))
    r = _upload(client, "gap", tmp_path, [*names[:2], "added_tokens.json"])
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert f"'{TOOL}' has id {gap}" in err["message"] and "added_tokens.json" in err["message"]
    assert "gap" not in [m.id for m in client.models.list()]


def test_reasoning_parser_sees_the_adapters_tokens(server):
    """The adapter names the qwen3 reasoning parser and adds ``<think>`` / ``</think>``: the
    parser finds their ids in the adapter's tokenizer, so a first ``</think>`` ends the thought
    at once (with the base's tokenizer the ids are unknown: every token would be thought)."""
    client, tok, _, _ = server
    end = len(tok) - 2 + 1  # the thinker's </think>: the base's length + 1
    out = client.chat.completions.create(
        model="thinker", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logit_bias={str(end): 100})
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
