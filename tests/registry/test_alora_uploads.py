"""aLoRA uploads: stored with kind ``aLoRA`` and the invocation kept in the stored config; a bad
``alora_invocation_tokens`` is refused naming the field, and nothing is stored."""

from __future__ import annotations

import json

import pytest
from test_upload_corpus import assert_nothing_stored


def _with_invocation(path, value):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = value
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def test_alora_stored_with_its_kind(registry, make_adapter):
    registry.create_tenant("acme")
    handle = registry.upload("acme", "checker", _with_invocation(make_adapter(), [10, 11, 12]))
    assert handle.kind == "aLoRA"
    assert handle.config["alora_invocation_tokens"] == [10, 11, 12]
    assert handle.to_dict()["kind"] == "aLoRA"


@pytest.mark.parametrize("value, match", [
    ([], "non-empty list"),
    ([1, "x"], "non-negative integers"),
    ([1, 10**9], "outside the base model's vocabulary"),
])
def test_bad_invocation_refused_and_nothing_stored(registry, make_adapter, tmp_path, value, match):
    from loramux.adapters.errors import AdapterValidationError

    registry.create_tenant("acme")
    with pytest.raises(AdapterValidationError, match=f"alora_invocation_tokens: .*{match}") as e:
        registry.upload("acme", "bad", _with_invocation(make_adapter(), value))
    assert e.value.field == "alora_invocation_tokens"
    assert_nothing_stored(registry, tmp_path)
