"""``loramux`` CLI: db upgrade, tenants, adapters validate/upload/list, export — on the
embedded layout (SQLite + FileStore in a data dir), run from an unrelated directory."""

from __future__ import annotations

import json

import pytest
from support.adapters import write_random_adapter

from loramux.platform.cli import main
from loramux.registry.db import Database


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    for var in ("LORAMUX_DATABASE_URL", "LORAMUX_S3_BUCKET", "LORAMUX_DATA_DIR", "LORAMUX_MODEL"):
        monkeypatch.delenv(var, raising=False)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    data = ["--data-dir", str(tmp_path / "data")]

    def run(*argv: str) -> tuple[int, str, str]:
        """Run ``loramux argv``; registry commands get ``--data-dir`` (``validate`` has none)."""
        capsys.readouterr()
        rc = main(list(argv) if argv[:2] == ("adapters", "validate") else [*argv, *data])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_cli_flow(cli, tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    adapter = write_random_adapter(config, tmp_path / "adapter", r=4, std=0.02)
    base = ["--base-model", str(tiny_model_dir)]

    rc, out, _ = cli("db", "upgrade")
    head = Database("sqlite://").head_revision()
    assert rc == 0 and f"revision {head}" in out
    rc, out, err = cli("tenants", "create", "acme")
    assert rc == 0 and out.strip().startswith("lmx_") and "only once" in err
    rc, out, _ = cli("adapters", "validate", str(adapter), *base)
    assert rc == 0 and out.startswith("ok: rank 4")
    rc, out, _ = cli("adapters", "upload", str(adapter), "--tenant", "acme", "--name", "sql", *base)
    assert rc == 0 and "uploaded 'sql' v1" in out
    rc, out, _ = cli("adapters", "list", "--tenant", "acme", "--json")
    [row] = [json.loads(line) for line in out.splitlines()]
    assert row["name"] == "sql" and row["rank"] == 4
    rc, out, _ = cli("adapters", "list", "--tenant", "acme")
    assert rc == 0 and out.startswith("sql\tv1\trank 4")
    export_dir = tmp_path / "merged"
    rc, out, err = cli(
        "export", "sql", "--tenant", "acme", "--out", str(export_dir), "--check", *base
    )
    assert rc == 0, err
    assert (export_dir / "config.json").is_file() and (export_dir / "model.safetensors").is_file()
    assert (export_dir / "tokenizer_config.json").is_file()
    rc, out, _ = cli("gc", "--min-age", "0")
    assert rc == 0 and "deleted 0 objects" in out


def test_cli_errors(cli, tiny_model_dir, tmp_path):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    adapter = write_random_adapter(config, tmp_path / "adapter", r=4)
    (adapter / "adapter_config.json").write_text("{not json")
    rc, _, err = cli("adapters", "validate", str(adapter), "--base-model", str(tiny_model_dir))
    assert rc == 1 and "adapter refused" in err and "invalid JSON" in err
    rc, _, err = cli("adapters", "list", "--tenant", "nobody")
    assert rc == 1 and "tenant 'nobody' not found" in err
    rc, _, err = cli("tenants", "create", "bad name")
    assert rc == 1 and "invalid tenant name" in err
    with pytest.raises(SystemExit):
        cli("adapters", "upload", str(adapter))  # --tenant and --name are required


def test_cli_releases(cli, tiny_model_dir, tmp_path):
    """versions, rollout (show / set / follow the latest), rollback, delete-version."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    base = ["--base-model", str(tiny_model_dir)]
    assert cli("tenants", "create", "acme")[0] == 0
    for i in range(3):
        folder = write_random_adapter(config, tmp_path / f"v{i}", r=4, seed=i)
        rc, out, _ = cli("adapters", "upload", str(folder), "--tenant", "acme", "--name", "sql",
                         *base)
        assert rc == 0 and f"uploaded 'sql' v{i + 1}" in out
    rc, out, _ = cli("adapters", "versions", "sql", "--tenant", "acme")
    lines = out.splitlines()
    assert rc == 0 and [line.split("\t")[:2] for line in lines[:3]] == [
        ["v1", "0%"], ["v2", "0%"], ["v3", "100%"]]
    assert lines[3] == "sql: v3 100% (follows the latest); sticky user; rollback to v2"
    rc, out, _ = cli("adapters", "rollout", "sql", "--tenant", "acme", "--weights", "2=90,3=10",
                     "--sticky", "key")
    assert rc == 0 and out.strip() == "sql: v2 90%, v3 10%; sticky key; rollback to v2"
    rc, _, err = cli("adapters", "rollout", "sql", "--tenant", "acme", "--weights", "2=90,3=20")
    assert rc == 1 and "sum to 100" in err
    rc, _, err = cli("adapters", "delete-version", "sql", "3", "--tenant", "acme")
    assert rc == 1 and "is in its rollout (2: 90%, 3: 10%)" in err
    rc, out, _ = cli("adapters", "rollback", "sql", "--tenant", "acme")
    assert rc == 0 and out.startswith("sql: v2 100%;")
    rc, out, _ = cli("adapters", "delete-version", "sql", "1", "--tenant", "acme")
    assert rc == 0 and out.strip() == "deleted 'sql' v1"
    rc, out, _ = cli("adapters", "rollout", "sql", "--tenant", "acme", "--follow-latest")
    assert rc == 0 and out.startswith("sql: v3 100% (follows the latest)")
    rc, out, _ = cli("adapters", "versions", "sql", "--tenant", "acme", "--json")
    assert [json.loads(line)["version"] for line in out.splitlines()] == [2, 3]
