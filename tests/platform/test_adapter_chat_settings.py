"""Per-adapter chat templates and parsers through the adapter API: what an upload picks up
(``chat_template.jinja``, ``tokenizer_config.json``, form fields), PATCH set and clear, the
refusals (unknown parser, a parser the tokenizer cannot serve, a template too long or that
does not render) storing nothing, GET and the list, and the resolver's ``ServedModel``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support.platform_settings import settings

from loramux.platform.app import create_app
from loramux.platform.identity import Caller
from loramux.platform.state import close_state
from loramux.registry.chat import template_digest

TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
OTHER = TEMPLATE.replace("<|assistant|>", "<|bot|>")


def _files(folder: Path, **extra: str) -> list:
    names = ("adapter_config.json", "adapter_model.safetensors")
    return [("file", (n, (folder / n).read_bytes())) for n in names] + [
        ("file", (n, text.encode())) for n, text in extra.items()]


async def _served(app, env, name: str):
    return await app.services.resolver.resolve(Caller(env.tenant_a), name)


async def _upload(client, env, folder, name, files=None, **data):
    return await client.post("/v1/adapters", headers=env.headers(env.key_a),
                             data={"name": name, **data}, files=files or _files(folder))


async def test_upload_picks_up_jinja_file_then_versions_keep_or_replace_it(
        client, app, env, adapter_dirs, tiny_model_dir):
    tokenizer_json = (tiny_model_dir / "tokenizer.json").read_text()
    files = _files(adapter_dirs[0], **{"chat_template.jinja": TEMPLATE,
                                       "tokenizer.json": tokenizer_json})
    r = await _upload(client, env, None, "tpl", files=files, tool_call_parser="hermes")
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["chat_template"] == TEMPLATE and body["tool_call_parser"] == "hermes"
    assert body["chat_template_sha256"] == template_digest(TEMPLATE)
    assert body["chat_template_chars"] == len(TEMPLATE) and body["reasoning_parser"] is None
    got = (await client.get("/v1/adapters/tpl", headers=env.headers(env.key_a))).json()
    assert got["chat_template"] == TEMPLATE
    (listed,) = [a for a in (await client.get("/v1/adapters", headers=env.headers(env.key_a))
                             ).json()["data"] if a["id"] == "tpl"]
    assert "chat_template" not in listed  # the list has the digest and length, not the text
    assert listed["chat_template_sha256"] == template_digest(TEMPLATE)
    served = await _served(app, env, "tpl")
    assert (served.chat_template, served.tool_call_parser, served.reasoning_parser) == (
        TEMPLATE, "hermes", None)

    r = await _upload(client, env, adapter_dirs[1], "tpl")  # no template: kept
    assert r.status_code == 201 and r.json()["version"] == 2
    assert r.json()["chat_template"] == TEMPLATE and r.json()["tool_call_parser"] == "hermes"
    r = await _upload(client, env, adapter_dirs[2], "tpl", chat_template=OTHER)
    assert r.json()["version"] == 3 and r.json()["chat_template"] == OTHER
    for name in ("tpl", "tpl@1"):  # every version shares the adapter's settings
        assert (await _served(app, env, name)).chat_template == OTHER
    assert (await client.delete("/v1/adapters/tpl", headers=env.headers(env.key_a))).is_success


async def test_upload_reads_tokenizer_config_and_form_fields(client, app, env, adapter_dirs):
    named = [{"name": "default", "template": OTHER}, {"name": "tool_use", "template": TEMPLATE}]
    config = json.dumps({"chat_template": named, "model_max_length": 2048})
    files = _files(adapter_dirs[0], **{"tokenizer_config.json": config,
                                       "special_tokens_map.json": "{}"})
    r = await _upload(client, env, None, "cfg", files=files, tool_call_parser="hermes",
                      reasoning_parser="qwen3")
    assert r.status_code == 201, r.text
    assert r.json()["chat_template"] == TEMPLATE  # what transformers picks with tools
    served = await _served(app, env, "cfg")
    assert (served.tool_call_parser, served.reasoning_parser) == ("hermes", "qwen3")
    assert served.version == 1 and (await _served(app, env, "a-only")).chat_template is None
    assert app.services.resolver.base.chat_template is None
    assert (await client.delete("/v1/adapters/cfg", headers=env.headers(env.key_a))).is_success


async def test_patch_sets_and_clears_and_the_next_resolve_sees_it(client, app, env):
    h = env.headers(env.key_a)
    assert (await _served(app, env, "a-only")).chat_template is None  # cached now
    r = await client.patch("/v1/adapters/a-only", headers=h, json={
        "chat_template": TEMPLATE, "tool_call_parser": "pythonic", "reasoning_parser": "qwen3"})
    assert r.status_code == 200, r.text
    assert (r.json()["chat_template"], r.json()["tool_call_parser"]) == (TEMPLATE, "pythonic")
    served = await _served(app, env, "a-only")
    assert (served.chat_template, served.tool_call_parser, served.reasoning_parser) == (
        TEMPLATE, "pythonic", "qwen3")
    r = await client.patch("/v1/adapters/a-only", headers=h, json={"tool_call_parser": None})
    assert r.json()["tool_call_parser"] is None and r.json()["chat_template"] == TEMPLATE
    r = await client.patch("/v1/adapters/a-only", headers=h,
                           json={"chat_template": None, "reasoning_parser": None})
    assert r.json()["chat_template"] is None and r.json()["chat_template_sha256"] is None
    served = await _served(app, env, "a-only")
    assert (served.chat_template, served.tool_call_parser, served.reasoning_parser) == (
        None, None, None)
    event = env.registry.events(env.tenant_a.id, adapter_name="a-only", limit=1)[0]
    assert event.kind == "chat_changed" and event.details["chat_template"] is None
    r = await client.patch("/v1/adapters/b-only", headers=h, json={"chat_template": TEMPLATE})
    assert r.status_code == 404  # another tenant's adapter: like a missing one


@pytest.mark.parametrize("field, value, choices", [
    ("tool_call_parser", "no_such", "hermes"), ("reasoning_parser", "nope", "qwen3")])
async def test_unknown_parser_is_400_naming_field_and_choices(client, env, adapter_dirs,
                                                              field, value, choices):
    r = await client.patch("/v1/adapters/a-only", headers=env.headers(env.key_a),
                           json={field: value, "description": "changed?"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "invalid_parser"
    assert value in err["message"] and choices in err["message"]
    got = (await client.get("/v1/adapters/a-only", headers=env.headers(env.key_a))).json()
    assert got[field] is None and got["description"] != "changed?"  # nothing stored
    r = await _upload(client, env, adapter_dirs[0], "never", **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert (await client.get("/v1/adapters/never", headers=env.headers(env.key_a))
            ).status_code == 404


async def test_parser_the_tokenizer_cannot_serve_is_400_naming_why(client, env):
    r = await client.patch("/v1/adapters/a-only", headers=env.headers(env.key_a),
                           json={"tool_call_parser": "llama3_json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_call_parser" and err["code"] == "parser_unsupported"
    assert "<|python_tag|>" in err["message"]


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ("{% for m in messages %}{{ m.tool_calls[0].function.name }}{% endfor %}", "UndefinedError"),
    ("{{ raise_exception('tools are not supported') }}", "tools are not supported"),
])
async def test_template_that_does_not_render_a_tool_call_is_422(client, env, adapter_dirs,
                                                                template, says):
    r = await client.patch("/v1/adapters/a-only", headers=env.headers(env.key_a),
                           json={"chat_template": template})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and err["code"] == "invalid_chat_template"
    assert says in err["message"]
    r = await _upload(client, env, None, "never",
                      files=_files(adapter_dirs[0], **{"chat_template.jinja": template}))
    assert r.status_code == 422 and says in r.json()["error"]["message"]
    h = env.headers(env.key_a)
    assert (await client.get("/v1/adapters/a-only", headers=h)).json()["chat_template"] is None
    assert (await client.get("/v1/adapters/never", headers=h)).status_code == 404


async def test_shipped_templates_transformers_cannot_pick_are_422(client, env, adapter_dirs):
    config = json.dumps({"chat_template": [{"name": "rag", "template": TEMPLATE}]})
    r = await _upload(client, env, None, "never",
                      files=_files(adapter_dirs[0], **{"tokenizer_config.json": config}))
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "chat_template" and "'default'" in r.json()["error"][
        "message"]


async def test_template_over_the_limit_is_413_naming_it(env, adapter_dirs):
    app = create_app(settings(max_chat_template_chars=100), engine=env.engine,
                     registry=env.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as client:
            r = await client.patch("/v1/adapters/a-only", headers=env.headers(env.key_a),
                                   json={"chat_template": TEMPLATE})
            assert r.status_code == 413, r.text
            err = r.json()["error"]
            assert err["param"] == "chat_template" and "max_chat_template_chars" in err["message"]
            assert "(100," in err["message"]
            r = await _upload(client, env, adapter_dirs[0], "never", chat_template=TEMPLATE)
            assert r.status_code == 413
    finally:
        close_state(app.services)


async def test_dashboard_shows_the_adapters_chat_settings(client, env):
    from support.platform_settings import ADMIN_KEY

    h = env.headers(env.key_a)
    r = await client.patch("/v1/adapters/a-only", headers=h,
                           json={"chat_template": TEMPLATE, "tool_call_parser": "hermes"})
    assert r.status_code == 200, r.text
    try:
        body = (await client.get("/admin/releases", headers=env.headers(ADMIN_KEY))).json()
        (row,) = [x for x in body["data"] if x["adapter"] == "a-only"]
        assert (row["tool_call_parser"], row["reasoning_parser"]) == ("hermes", None)
        assert row["chat_template_sha256"] == template_digest(TEMPLATE)
        assert row["chat_template_chars"] == len(TEMPLATE)
        assert (await client.post("/admin/login", data={"key": ADMIN_KEY})).status_code == 303
        page = (await client.get("/admin/ui/adapters")).text
        assert template_digest(TEMPLATE)[:12] in page and "tools: hermes" in page
        assert "reasoning: server&#39;s" in page or "reasoning: server's" in page
    finally:
        await client.patch("/v1/adapters/a-only", headers=h,
                           json={"chat_template": None, "tool_call_parser": None})


def test_cli_upload_takes_and_checks_the_same_settings(tiny_model_dir, adapter_dirs, tmp_path,
                                                       capsys, monkeypatch):
    from loramux.platform.cli import main
    from loramux.platform.settings import Settings

    for name in Settings.model_fields:
        monkeypatch.delenv(f"LORAMUX_{name.upper()}", raising=False)
    data = ["--data-dir", str(tmp_path / "data"), "--base-model", str(tiny_model_dir)]
    assert main(["tenants", "create", "acme", "--data-dir", str(tmp_path / "data")]) == 0
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    up = ["adapters", "upload", str(adapter_dirs[0]), "--tenant", "acme", "--name", "c", *data]
    capsys.readouterr()
    assert main([*up, "--tool-call-parser", "no_such"]) == 1
    err = capsys.readouterr().err
    assert "tool_call_parser 'no_such'" in err and "hermes" in err, err
    (tmp_path / "bad.jinja").write_text("{% for %}")
    assert main([*up, "--chat-template", str(tmp_path / "bad.jinja")]) == 1
    assert "does not render" in capsys.readouterr().err
    assert main([*up, "--chat-template", str(tmp_path / "t.jinja"),
                 "--tool-call-parser", "hermes"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["adapters", "list", "--tenant", "acme", "--json", *data[:2]]) == 0
    listed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert listed["chat_template"] == TEMPLATE and listed["tool_call_parser"] == "hermes"
    assert listed["version"] == 1  # the refused uploads stored nothing


def test_static_adapters_take_the_template_their_folder_ships(tmp_path, caplog):
    from loramux.platform.openai.resolver import ModelResolver

    shipped, broken = tmp_path / "shipped", tmp_path / "broken"
    for folder in (shipped, broken):
        folder.mkdir()
        (folder / "adapter_config.json").write_text("{}")
    (shipped / "chat_template.jinja").write_text(TEMPLATE)
    (broken / "tokenizer_config.json").write_text('{"chat_template": [{"name": "rag"}]}')
    resolver = ModelResolver(["base"], static_modules={"s": shipped, "b": broken})
    assert resolver.static["s"].chat_template == TEMPLATE
    assert resolver.static["s"].tool_call_parser is None  # parsers: the server's
    assert resolver.static["b"].chat_template is None and "--lora-modules b" in caplog.text
