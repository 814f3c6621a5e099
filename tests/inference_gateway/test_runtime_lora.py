"""vLLM's dynamic LoRA API: every status code (200 with vLLM's plain-text bodies; 400
missing field / non-JSON / duplicate / outside the allow-list; 404 unknown path or
adapter; off by default), the path allow-list (``..``, symlinks, another tenant's
prefix: 400 and nothing read), a load then a completion on that name, an unload then
404, and ``/v1/models`` listing it as vLLM does."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import httpx
import pytest
from support.gateway import Tenants
from support.platform_settings import settings
from support.server import free_port

from loramux.platform.app import create_app
from loramux.platform.state import close_state


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory, tenants) -> Path:
    """/…/loras/<tenant>/<adapter> folders the server may read, and a secret outside."""
    root = tmp_path_factory.mktemp("loras")
    for tenant in ("alpha", "beta"):
        (root / tenant).mkdir()
    shutil.copytree(tenants.adapter_dirs[0], root / "alpha" / "mine")
    shutil.copytree(tenants.adapter_dirs[1], root / "beta" / "theirs")
    outside = tmp_path_factory.mktemp("outside")
    shutil.copytree(tenants.adapter_dirs[2], outside / "secret")
    os.symlink(outside / "secret", root / "alpha" / "link")
    (root / "alpha" / "half").mkdir()
    os.symlink(outside / "secret" / "adapter_model.safetensors",
               root / "alpha" / "half" / "adapter_model.safetensors")
    shutil.copy(outside / "secret" / "adapter_config.json", root / "alpha" / "half")
    (root / "alpha" / "empty").mkdir()
    return root


@contextlib.asynccontextmanager
async def client_for(tenants, engine, **overrides):
    app = create_app(settings(**overrides), engine=engine, registry=tenants.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t", timeout=60) as c:
            yield c
    finally:
        close_state(app.services)


@pytest.fixture
async def client(tenants, engine, lora_root):
    async with client_for(tenants, engine, allow_runtime_lora_updating=True,
                          lora_path_allow=[str(lora_root / "{tenant}")]) as c:
        yield c


def load(name: str, path: str, **extra) -> dict:
    return {"lora_name": name, "lora_path": path, **extra}


async def test_off_unless_allowed(tenants, engine, monkeypatch):
    async with client_for(tenants, engine) as c:
        r = await c.post("/v1/load_lora_adapter", json=load("x", "/tmp"),
                         headers=Tenants.auth(tenants.alpha_key))
        assert r.status_code == 404
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's variable
    async with client_for(tenants, engine) as c:
        r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"},
                         headers=Tenants.auth(tenants.alpha_key))
        assert r.status_code == 404
        assert r.json()["error"]["message"] == "The lora adapter 'never-loaded' cannot be found."


async def test_load_serve_list_unload(client, tenants, lora_root):
    h = Tenants.auth(tenants.alpha_key)
    path = str(lora_root / "alpha" / "mine")
    r = await client.post("/v1/load_lora_adapter", json=load("runtime-x", path), headers=h)
    assert r.status_code == 200, r.text
    assert r.text == "Success: LoRA adapter 'runtime-x' added successfully."
    assert r.headers["content-type"].startswith("text/plain")
    r = await client.post("/v1/completions", headers=h,
                          json={"model": "runtime-x", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "runtime-x"
    cards = {c["id"]: c for c in (await client.get("/v1/models", headers=h)).json()["data"]}
    assert cards["runtime-x"]["parent"] == "tiny" and cards["runtime-x"]["root"]
    assert cards["tiny"]["parent"] is None
    # beta does not see it, and cannot use or unload it
    hb = Tenants.auth(tenants.beta_key)
    assert "runtime-x" not in {c["id"] for c in (await client.get("/v1/models", headers=hb)).json()["data"]}
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "runtime-x"}, headers=hb)
    assert r.status_code == 404
    # a second load of the name: vLLM's duplicate; load_inplace replaces it
    r = await client.post("/v1/load_lora_adapter", json=load("runtime-x", path), headers=h)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "The lora adapter 'runtime-x' has already been loaded."
    r = await client.post("/v1/load_lora_adapter", json=load("runtime-x", path, load_inplace=True),
                          headers=h)
    assert r.status_code == 200, r.text
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "runtime-x"}, headers=h)
    assert r.status_code == 200
    assert r.text == "Success: LoRA adapter 'runtime-x' removed successfully."
    r = await client.post("/v1/completions", headers=h,
                          json={"model": "runtime-x", "prompt": "hello", "max_tokens": 3})
    assert r.status_code == 404
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "runtime-x"}, headers=h)
    assert r.status_code == 404


async def test_bad_requests_are_400(client, tenants, lora_root):
    h = Tenants.auth(tenants.alpha_key)
    path = str(lora_root / "alpha" / "mine")
    for body in ({"lora_name": "x"}, {"lora_path": path}, {"lora_name": "", "lora_path": path},
                 {}):
        r = await client.post("/v1/load_lora_adapter", json=body, headers=h)
        assert r.status_code == 400, body
        assert r.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
    r = await client.post("/v1/load_lora_adapter", content=b"lora_name=x", headers={
        **h, "content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    r = await client.post("/v1/load_lora_adapter", content=b"{not json", headers={
        **h, "content-type": "application/json"})
    assert r.status_code == 400
    r = await client.post("/v1/load_lora_adapter", json=["x"], headers=h)
    assert r.status_code == 400
    r = await client.post("/v1/load_lora_adapter", json=load(5, path), headers=h)
    assert r.status_code == 400
    r = await client.post("/v1/unload_lora_adapter", json={}, headers=h)
    assert r.status_code == 400
    r = await client.post("/v1/load_lora_adapter", json=load("tiny", path), headers=h)
    assert r.status_code == 400  # the base model's name
    r = await client.post("/v1/load_lora_adapter", json=load("bad name!", path), headers=h)
    assert r.status_code == 400
    r = await client.post("/v1/load_lora_adapter", json=load("x", path))
    assert r.status_code == 401  # the adapter is a tenant's: a key is required


async def test_unknown_path_is_404(client, tenants, lora_root):
    h = Tenants.auth(tenants.alpha_key)
    for path in (lora_root / "alpha" / "missing", lora_root / "alpha" / "empty"):
        r = await client.post("/v1/load_lora_adapter", json=load("x", str(path)), headers=h)
        assert r.status_code == 404, r.text
        assert r.json()["error"]["message"] == f"No adapter found for {path}"


async def test_an_invalid_adapter_is_400(client, tenants, lora_root, tmp_path):
    h = Tenants.auth(tenants.alpha_key)
    bad = lora_root / "alpha" / "bad"
    shutil.copytree(lora_root / "alpha" / "mine", bad, dirs_exist_ok=True)
    (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    r = await client.post("/v1/load_lora_adapter", json=load("x", str(bad)), headers=h)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_adapter"


async def test_paths_outside_the_allow_list_are_refused_unread(client, tenants, lora_root,
                                                                monkeypatch):
    from loramux.platform.adapter_api import service, uploads

    reads = []
    for module in (service, uploads):
        monkeypatch.setattr(module, "read_local", lambda *a, **k: reads.append(a) or 1 / 0)
    monkeypatch.setattr(uploads, "fetch_s3", lambda *a, **k: reads.append(a) or 1 / 0)
    monkeypatch.setattr(service, "fetch_s3", lambda *a, **k: reads.append(a) or 1 / 0)
    h = Tenants.auth(tenants.alpha_key)
    for path in (
        "/etc",                                          # outside every prefix
        "relative/mine",                                 # not absolute
        str(lora_root / "alpha" / ".." / "beta" / "theirs"),  # ..
        str(lora_root / "beta" / "theirs"),              # another tenant's prefix
        str(lora_root / "alpha" / "link"),               # a symlink to a folder outside
        str(lora_root / "alpha" / "half"),               # a symlinked weights file
        str(lora_root / "alpha"),                        # the prefix itself
        str(lora_root / "alphabet"),                     # a sibling sharing the prefix's text
    ):
        r = await client.post("/v1/load_lora_adapter", json=load("x", path), headers=h)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["code"] in ("lora_path_not_allowed", "invalid_parameter"), path
    assert reads == []
    for source in ("s3://other-bucket/imports/alpha/x/", "s3://b/imports/beta/x/",
                   "s3://b/imports/alpha/../beta/x/", "s3:/nope"):
        r = await client.post("/v1/load_lora_adapter", json=load("x", source), headers=h)
        assert r.status_code == 400, (source, r.text)
    assert reads == []


async def test_load_from_s3(tenants, engine, monkeypatch):
    import boto3

    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="lmx")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            s3.upload_file(str(tenants.adapter_dirs[3] / name), "lmx", f"imports/beta/ad/{name}")
            s3.upload_file(str(tenants.adapter_dirs[3] / name), "lmx", f"imports/alpha/ad/{name}")
        async with client_for(tenants, engine, allow_runtime_lora_updating=True,
                              s3_bucket="lmx", s3_endpoint_url=endpoint) as c:
            h = Tenants.auth(tenants.beta_key)
            r = await c.post("/v1/load_lora_adapter", json=load("from-s3", "s3://lmx/imports/beta/ad/"),
                             headers=h)
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", headers=h,
                             json={"model": "from-s3", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/load_lora_adapter", json=load("y", "s3://lmx/imports/beta/none/"),
                             headers=h)
            assert r.status_code == 404
            r = await c.post("/v1/load_lora_adapter", json=load("z", "s3://lmx/imports/alpha/ad/"),
                             headers=h)
            assert r.status_code == 400  # alpha's prefix
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "from-s3"}, headers=h)
            assert r.status_code == 200
    finally:
        server.stop()
