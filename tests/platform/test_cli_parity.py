"""The CLI and the HTTP API hold the same rules: one preset validator (same refusal,
same words), one set of limits (`adapters upload` refuses a rank `serve` would not serve),
and `loramux serve --help` documents every Settings field."""

from __future__ import annotations

import json

import pytest
from support.adapters import write_random_adapter

from loramux.platform.cli import build_parser, main
from loramux.platform.settings import Settings


@pytest.fixture
def no_env(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(f"LORAMUX_{name.upper()}", raising=False)


@pytest.mark.parametrize("preset", [{"temperature": -1}, {"top_k": "x"}, {"no_such": 1}])
async def test_preset_refused_over_http_is_refused_by_cli_with_same_message(
    client, env, adapter_dirs, tiny_model_dir, tmp_path, capsys, no_env, preset
):
    r = await client.patch("/v1/adapters/a-only", headers=env.headers(env.key_a),
                           json={"preset": preset})
    assert r.status_code == 400, r.text
    http_message = r.json()["error"]["message"]

    capsys.readouterr()
    rc = main(["adapters", "upload", str(adapter_dirs[0]), "--tenant", "alpha", "--name", "p",
               "--preset", json.dumps(preset), "--base-model", str(tiny_model_dir),
               "--data-dir", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.strip() == f"error: {http_message}"


def test_cli_upload_above_serving_rank_is_refused_naming_both(tiny_model_dir, tmp_path, capsys,
                                                              no_env, monkeypatch):
    big = write_random_adapter(tiny_model_dir, tmp_path / "r32", r=32)
    data = ["--data-dir", str(tmp_path / "data"), "--base-model", str(tiny_model_dir)]
    assert main(["tenants", "create", "acme", "--data-dir", str(tmp_path / "data")]) == 0
    capsys.readouterr()
    # no --max-lora-rank: the serving default (16) applies, as it does for `serve`
    rc = main(["adapters", "upload", str(big), "--tenant", "acme", "--name", "big", *data])
    err = capsys.readouterr().err
    assert rc == 1 and "rank 32" in err and "max_lora_rank=16" in err, err
    # the same limit from the environment, as `serve` would read it
    monkeypatch.setenv("LORAMUX_MAX_LORA_RANK", "8")
    small = write_random_adapter(tiny_model_dir, tmp_path / "r12", r=12)
    rc = main(["adapters", "upload", str(small), "--tenant", "acme", "--name", "small", *data])
    err = capsys.readouterr().err
    assert rc == 1 and "rank 12" in err and "max_lora_rank=8" in err, err
    rc = main(["adapters", "upload", str(small), "--tenant", "acme", "--name", "small",
               "--max-lora-rank", "16", *data])
    assert rc == 0, capsys.readouterr().err


def test_serve_help_lists_every_settings_field():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for name, info in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in text, f"{flag} missing from `loramux serve --help`"
        assert info.description, f"Settings.{name} has no docstring (its --help text)"
    assert "LORAMUX_MAX_LORA_RANK" in text
