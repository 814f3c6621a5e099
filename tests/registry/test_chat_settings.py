"""An adapter's chat settings in the registry: the template an upload ships (transformers'
files and rule), what a new version keeps, ``set_chat`` and its event and audit row."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from loramux.registry import InvalidChatSettings
from loramux.registry.chat import read_chat_template, template_digest

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def _with(folder, **files):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if isinstance(text, str) else json.dumps(text))
    return folder


def test_read_template_follows_transformers(tmp_path):
    assert read_chat_template(tmp_path) is None
    _with(tmp_path, **{"tokenizer_config.json": {"chat_template": "from-config"}})
    assert read_chat_template(tmp_path) == "from-config"
    named = [{"name": "default", "template": "d"}, {"name": "tool_use", "template": "t"}]
    _with(tmp_path, **{"tokenizer_config.json": {"chat_template": named}})
    assert read_chat_template(tmp_path) == "t"  # what transformers picks with tools
    _with(tmp_path, **{"tokenizer_config.json": {"chat_template": named[:1]}})
    assert read_chat_template(tmp_path) == "d"
    _with(tmp_path, **{"chat_template.jinja": "from-file"})  # files beat the config
    assert read_chat_template(tmp_path) == "from-file"
    _with(tmp_path, **{"additional_chat_templates/tool_use.jinja": "tools-file"})
    assert read_chat_template(tmp_path) == "tools-file"


@pytest.mark.parametrize("config, says", [
    ({"chat_template": [{"name": "rag", "template": "r"}]}, "none named 'default'"),
    ({"chat_template": 3}, "must be a string or a list"),
    ("{not json", "not valid JSON"),
])
def test_unusable_tokenizer_config_is_refused_naming_it(tmp_path, config, says):
    (tmp_path / "tokenizer_config.json").write_text(
        config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(InvalidChatSettings, match=says) as e:
        read_chat_template(tmp_path)
    assert e.value.param == "chat_template"


def test_upload_stores_shipped_template_and_new_versions_keep_it(registry, make_adapter):
    registry.create_tenant("acme")
    src = _with(make_adapter("a"), **{"chat_template.jinja": TEMPLATE,
                                      "tokenizer.json": "{}", "special_tokens_map.json": "{}"})
    h1 = registry.upload("acme", "chat", src, tool_call_parser="hermes")
    assert (h1.chat_template, h1.tool_call_parser, h1.reasoning_parser) == (TEMPLATE, "hermes",
                                                                            None)
    # only the weights are stored: the tokenizer files are not objects of their own
    assert [o.key for o in registry.store.list("")] == [h1.object_key]

    plain = make_adapter("b", seed=1)  # no template, no parser: both kept
    h2 = registry.upload("acme", "chat", plain, reasoning_parser="qwen3")
    assert (h2.version, h2.chat_template, h2.tool_call_parser, h2.reasoning_parser) == (
        2, TEMPLATE, "hermes", "qwen3")
    assert registry.get_version("acme", "chat", 1).chat_template == TEMPLATE  # shared

    buf = io.BytesIO()  # an archive carrying tokenizer_config.json's template replaces it
    other = _with(make_adapter("c", seed=2), **{"tokenizer_config.json": {"chat_template": "x"}})
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for p in other.iterdir():
            tf.add(p, arcname=f"pkg/{p.name}")
    archive = other.parent / "c.tar.gz"
    archive.write_bytes(buf.getvalue())
    h3 = registry.upload("acme", "chat", archive)
    assert h3.chat_template == "x" and h3.tool_call_parser == "hermes"
    h4 = registry.upload("acme", "chat", plain, chat_template="explicit")  # beats the folder
    assert h4.chat_template == "explicit"


def test_set_chat_changes_clears_and_is_heard(registry, make_adapter):
    registry.create_tenant("acme")
    registry.upload("acme", "chat", make_adapter())
    heard = []
    registry.subscribe(lambda kind, handle: heard.append((kind, handle)))
    h = registry.set_chat("acme", "chat", chat_template=TEMPLATE, tool_call_parser="hermes",
                          actor="alice")
    assert (h.chat_template, h.tool_call_parser, h.reasoning_parser) == (TEMPLATE, "hermes", None)
    assert heard[-1][0] == "chat_changed" and heard[-1][1].chat_template == TEMPLATE
    event = registry.events("acme", adapter_name="chat", limit=1)[0]
    assert event.kind == "chat_changed" and event.actor == "alice"
    assert event.details == {"tool_call_parser": "hermes", "chat_template": {
        "sha256": template_digest(TEMPLATE), "chars": len(TEMPLATE)}}  # never the text

    h = registry.set_chat("acme", "chat", chat_template=None)  # the others stay
    assert (h.chat_template, h.tool_call_parser) == (None, "hermes")
    assert registry.resolve("acme", "chat").newest.tool_call_parser == "hermes"
    assert registry.get("acme", "chat").to_dict()["tool_call_parser"] == "hermes"


@pytest.mark.parametrize("changes", [{"tool_call_parser": "bad name!"},
                                     {"reasoning_parser": "x" * 65},
                                     {"chat_template": 7}])
def test_bad_stored_shape_is_refused_and_nothing_changes(registry, make_adapter, changes):
    registry.create_tenant("acme")
    registry.upload("acme", "chat", make_adapter())
    with pytest.raises(InvalidChatSettings) as e:
        registry.set_chat("acme", "chat", **changes)
    assert e.value.param == next(iter(changes))
    h = registry.get("acme", "chat")
    assert (h.chat_template, h.tool_call_parser, h.reasoning_parser) == (None, None, None)
    with pytest.raises(InvalidChatSettings):
        registry.upload("acme", "other", make_adapter("o"), **changes)
    assert [x.name for x in registry.list("acme")] == ["chat"]
