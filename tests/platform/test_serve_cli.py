"""``loramux serve`` flags → Settings; first-start bootstrap prints keys once."""

from __future__ import annotations

import io

from loramux.platform.cli import build_parser
from loramux.platform.cli.serve import DEMO_ADAPTER, bootstrap, serve_settings
from loramux.platform.settings import Settings


def test_flags_mirror_vllm_and_fall_back_to_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LORAMUX_MAX_LORAS", "7")
    monkeypatch.setenv("LORAMUX_PORT", "9001")
    args = build_parser().parse_args([
        "serve", "/models/llama", "--max-model-len", "1024", "--max-num-seqs", "32",
        "--dtype", "bfloat16", "--enable-lora", "--max-lora-rank", "32", "--max-cpu-loras", "16",
        "--lora-modules", f"sql={tmp_path}", f'{{"name": "x", "path": "{tmp_path}"}}',
        "--gpu-memory-utilization", "0.8", "--database-url", "sqlite:///x.db",
        "--s3-bucket", "b", "--s3-endpoint-url", "http://minio:9000", "--data-dir", str(tmp_path),
        "--served-model-name", "llama", "meta-llama/Llama",
    ])
    s = serve_settings(args)
    assert s.model == "/models/llama" and s.max_model_len == 1024 and s.max_num_seqs == 32
    assert s.dtype == "bfloat16" and s.enable_lora and s.max_lora_rank == 32 and s.max_cpu_loras == 16
    assert s.max_loras == 7 and s.port == 9001 and s.host == "127.0.0.1"
    assert s.lora_modules == [f"sql={tmp_path}", f'{{"name": "x", "path": "{tmp_path}"}}']
    assert s.gpu_memory_utilization == 0.8 and s.s3_bucket == "b" and s.data_dir == tmp_path
    assert s.served_model_name == ["llama", "meta-llama/Llama"]
    assert not build_parser().parse_args(["serve", "--no-enable-lora"]).enable_lora


def test_env_lists(monkeypatch):
    monkeypatch.setenv("LORAMUX_LORA_MODULES", "a=/x b=/y")
    monkeypatch.setenv("LORAMUX_SERVED_MODEL_NAME", '["m1", "m2"]')
    s = Settings()
    assert s.lora_modules == ["a=/x", "b=/y"] and s.served_model_name == ["m1", "m2"]


class _State:
    def __init__(self, registry, settings):
        self.registry = registry
        self.settings = settings


def test_bootstrap_creates_keys_once(env, tmp_path, tiny_model_dir):
    from support.server import make_registry

    registry = make_registry(tmp_path / "reg", tiny_model_dir, max_lora_rank=16)
    settings = Settings(demo_adapter_dir=env.adapter_dirs[0])
    out = io.StringIO()
    keys = bootstrap(_State(registry, settings), out=out)
    assert set(keys) == {"admin", "demo"} and keys["admin"] in out.getvalue()
    admin = registry.authenticate_key(keys["admin"])
    assert admin.is_admin and admin.tenant.name == "admin"
    demo = registry.authenticate(keys["demo"])
    handle = registry.get(demo.id, DEMO_ADAPTER)
    assert handle.default_preset["temperature"] == 0.0 and handle.default_preset["stop"] == [";"]
    again = io.StringIO()
    assert bootstrap(_State(registry, settings), out=again) == {} and again.getvalue() == ""
    registry.db.dispose()
