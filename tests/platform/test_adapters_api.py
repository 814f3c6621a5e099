"""Tenant adapter API: uploads (multipart files, archive, s3://), caps, preset PATCH,
delete (evicts from the engine), a new version (its own engine key), export to the store."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import httpx
import pytest
from support.adapters import write_random_adapter
from support.platform_settings import ADMIN_KEY, settings
from support.server import free_port

from loramux.platform.app import create_app
from loramux.platform.state import close_state


def _files(folder: Path) -> list:
    return [
        ("file", ("adapter_config.json", (folder / "adapter_config.json").read_bytes())),
        ("file", ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes())),
    ]


def _tar(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tf.add(folder / name, arcname=f"my-adapter/{name}")
    return buf.getvalue()


async def _engine_keys(client) -> set[str]:
    r = await client.get("/admin/adapters", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    return {row["key"] for row in r.json()["data"] if row["tier"] != "store"}


async def test_upload_use_patch_delete(client, env, adapter_dirs):
    h = env.headers(env.key_a)
    r = await client.post("/v1/adapters", files=_files(adapter_dirs[1]), headers=h,
                          data={"name": "up1", "preset": json.dumps({"temperature": 0, "stop": ["."]})})
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["id"] == "up1" and created["object"] == "adapter" and created["version"] == 1
    assert created["rank"] == 8 and created["default_preset"] == {"temperature": 0.0, "stop": ["."]}
    assert "object_key" not in created and "tenant_id" not in created
    assert (await client.get("/v1/adapters/up1", headers=h)).json()["sha256"] == created["sha256"]
    assert "up1" in [a["id"] for a in (await client.get("/v1/adapters", headers=h)).json()["data"]]

    r = await client.post("/v1/completions", headers=h,
                          json={"model": "up1", "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.headers["x-loramux-preset"] == "stop,temperature"
    keys = await _engine_keys(client)
    (key,) = [k for k in keys if "/up1@" in k]
    assert key.startswith(f"{env.tenant_a.id}/up1@")

    r = await client.patch("/v1/adapters/up1", headers=h, json={"preset": {"top_k": 3, "temperature": 0.5}})
    assert r.status_code == 200 and r.json()["default_preset"] == {"top_k": 3, "temperature": 0.5}
    r = await client.post("/v1/completions", headers=h, json={"model": "up1", "prompt": "hi", "max_tokens": 2})
    assert json.loads(r.headers["x-loramux-params"])["top_k"] == 3
    r = await client.patch("/v1/adapters/up1", headers=h, json={"preset": {"top_k": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("preset")
    r = await client.patch("/v1/adapters/up1", headers=h, json={"preset": None})
    assert r.status_code == 200 and r.json()["default_preset"] is None

    r = await client.delete("/v1/adapters/up1", headers=h)
    assert r.status_code == 200 and r.json() == {"id": "up1", "object": "adapter", "deleted": True}
    assert key not in await _engine_keys(client)  # evicted from the engine
    r = await client.post("/v1/completions", headers=h, json={"model": "up1", "prompt": "hi"})
    assert r.status_code == 404
    assert (await client.get("/v1/adapters/up1", headers=h)).status_code == 404


async def test_archive_upload_then_a_new_version(client, env, adapter_dirs):
    h = env.headers(env.key_a)
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    r = await client.post("/v1/adapters", headers=h, data={"name": "arch"},
                          files={"file": ("adapter.tar.gz", _tar(adapter_dirs[0]))})
    assert r.status_code == 201, r.text
    first = await client.post("/v1/completions", headers=h, json={"model": "arch", **body})
    assert first.headers["x-loramux-adapter-version"] == "1"
    old = {k for k in await _engine_keys(client) if "/arch@" in k}
    r = await client.post("/v1/adapters?replace=true", headers=h, data={"name": "arch"},
                          files=_files(adapter_dirs[2]))
    assert r.status_code == 201 and r.json()["version"] == 2
    out = await client.post("/v1/completions", headers=h, json={"model": "arch", **body})
    ref = await client.post("/v1/completions", headers=env.headers(env.key_b),
                            json={"model": "b-only", **body})
    assert out.headers["x-loramux-adapter-version"] == "2" and out.json()["model"] == "arch"
    assert out.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]  # new weights
    pinned = await client.post("/v1/completions", headers=h, json={"model": "arch@1", **body})
    assert pinned.headers["x-loramux-adapter-version"] == "1"
    assert pinned.json()["model"] == "arch@1"  # the name the client sent
    assert pinned.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]  # kept
    new = {k for k in await _engine_keys(client) if "/arch@" in k}
    assert old and old < new  # a version is its own engine adapter; the old one stays
    assert (await client.delete("/v1/adapters/arch", headers=h)).status_code == 200
    assert not {k for k in await _engine_keys(client) if "/arch@" in k}  # every version left


async def test_bad_uploads(client, env, adapter_dirs, tiny_model_dir, tmp_path):
    h = env.headers(env.key_a)
    r = await client.post("/v1/adapters", headers=h, files=_files(adapter_dirs[0]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    r = await client.post("/v1/adapters", headers=h, data={"name": "bad name!"}, files=_files(adapter_dirs[0]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "name"
    big_rank = write_random_adapter(tiny_model_dir, tmp_path / "r64", r=64)
    r = await client.post("/v1/adapters", headers=h, data={"name": "r64"}, files=_files(big_rank))
    assert r.status_code == 422 and r.json()["error"]["param"] == "r"
    r = await client.post("/v1/adapters", headers=h, data={"name": "pkl"},
                          files={"file": ("adapter_model.bin", b"\x80\x04garbage")})
    assert r.status_code == 422 and "pickle" in r.json()["error"]["message"]
    r = await client.post("/v1/adapters", headers={**h, "content-type": "text/plain"}, content=b"raw")
    assert r.status_code == 415
    r = await client.post("/v1/adapters", headers={**h, "content-type": "multipart/form-data; boundary=zz"},
                          content=b"--zz\r\nnot a real part")
    assert r.status_code in (400, 422)
    r = await client.post("/v1/adapters", data={"name": "x"}, files=_files(adapter_dirs[0]))
    assert r.status_code == 401
    names = [a["id"] for a in (await client.get("/v1/adapters", headers=h)).json()["data"]]
    assert names == ["a-only", "sql-lora"]  # failed uploads left nothing behind


async def test_upload_size_cap_is_413(env, adapter_dirs):
    app = create_app(settings(max_upload_bytes=4096), engine=env.engine, registry=env.registry)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/adapters", headers=env.headers(env.key_a), data={"name": "huge"},
                             files=_files(adapter_dirs[0]))
            assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
            scratch = app.services.scratch_dir
            assert not any(scratch.glob("upload-*"))  # the partial upload was removed
    finally:
        close_state(app.services)


async def test_export_writes_merged_model_to_store(client, env):
    h = env.headers(env.key_a)
    r = await client.post("/v1/adapters/a-only/export", headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["location"].startswith("file://") and body["version"] == 1
    from urllib.parse import urlparse

    folder = Path(urlparse(body["location"]).path)
    assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
    assert any(f.endswith("config.json") for f in body["files"])


@pytest.fixture(scope="module")
def moto_s3():
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


async def test_upload_from_s3(env, adapter_dirs, moto_s3, monkeypatch):
    import boto3

    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3", endpoint_url=moto_s3, region_name="us-east-1")
    s3.create_bucket(Bucket="tenant-bucket")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        s3.upload_file(str(adapter_dirs[1] / name), "tenant-bucket", f"adapters/one/{name}")
    s3.put_object(Bucket="tenant-bucket", Key="archives/one.tar.gz", Body=_tar(adapter_dirs[1]))
    app = create_app(settings(s3_endpoint_url=moto_s3, s3_import_allow=["s3://tenant-bucket/adapters",
                                                                         "s3://tenant-bucket/archives/"]),
                     engine=env.engine, registry=env.registry)
    h = env.headers(env.key_a)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/adapters", headers=h, json={
                "name": "from-s3", "source": "s3://tenant-bucket/adapters/one/",
                "preset": {"temperature": 0}})
            assert r.status_code == 201, r.text
            assert r.json()["default_preset"] == {"temperature": 0.0}
            r = await c.post("/v1/adapters", headers=h, json={
                "name": "from-s3-tar", "source": "s3://tenant-bucket/archives/one.tar.gz"})
            assert r.status_code == 201, r.text
            r = await c.post("/v1/adapters", headers=h, json={
                "name": "nope", "source": "s3://tenant-bucket/adapters/missing/"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "source"
            for source in ("s3://other-bucket/adapters/one/", "s3://tenant-bucket/adapters-x/",
                           "s3://tenant-bucket/adapters/../secret/", "s3://tenant-bucket/"):
                r = await c.post("/v1/adapters", headers=h, json={"name": "nope", "source": source})
                assert r.status_code == 403 and r.json()["error"]["param"] == "source", source
                assert "bucket" not in r.json()["error"]["message"].replace("server's bucket", "")
            r = await c.post("/v1/adapters", headers=h, json={"name": "nope", "source": "/etc/passwd"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "source"
            for name in ("from-s3", "from-s3-tar"):
                assert (await c.delete(f"/v1/adapters/{name}", headers=h)).status_code == 200
    finally:
        close_state(app.services)


async def test_patch_description_round_trips(client, env):
    h = env.headers(env.key_a)
    r = await client.patch("/v1/adapters/a-only", headers=h, json={"description": "SQL, v1 data"})
    assert r.status_code == 200, r.text
    assert r.json()["description"] == "SQL, v1 data"
    assert (await client.get("/v1/adapters/a-only", headers=h)).json()["description"] == "SQL, v1 data"
    listed = {a["id"]: a for a in (await client.get("/v1/adapters", headers=h)).json()["data"]}
    assert listed["a-only"]["description"] == "SQL, v1 data"
    r = await client.patch("/v1/adapters/a-only", headers=h,
                           json={"description": "both", "preset": {"temperature": 0.2}})
    assert r.json()["description"] == "both" and r.json()["default_preset"] == {"temperature": 0.2}
    r = await client.patch("/v1/adapters/a-only", headers=h, json={"description": "x" * 2001})
    assert r.status_code == 400 and r.json()["error"]["param"] == "description"
    r = await client.patch("/v1/adapters/b-only", headers=h, json={"description": "not mine"})
    assert r.status_code == 404  # another tenant's adapter looks missing
    r = await client.patch("/v1/adapters/a-only", headers=h, json={"description": None, "preset": None})
    assert r.json()["description"] is None


async def test_dora_upload_says_its_kind_and_serves(client, env, tmp_path):
    """A PEFT DoRA adapter uploads, is listed as ``kind: DoRA`` (plain ones as LoRA), serves
    greedy tokens equal to PEFT's, and the dashboard shows its kind."""
    import torch
    from support.lora_fixtures import make_dora_adapter, peft_reference
    from transformers import AutoTokenizer

    folder = make_dora_adapter(env.model_dir, tmp_path / "dora", r=8, std=0.2,
                               target_modules=["q_proj", "v_proj", "down_proj"])
    h = env.headers(env.key_a)
    r = await client.post("/v1/adapters", files=_files(folder), headers=h, data={"name": "dora1"})
    assert r.status_code == 201, r.text
    assert r.json()["kind"] == "DoRA"
    listed = {a["id"]: a["kind"] for a in (await client.get("/v1/adapters", headers=h)).json()["data"]}
    assert listed["dora1"] == "DoRA" and listed["a-only"] == "LoRA"
    versions = (await client.get("/v1/adapters/dora1/versions", headers=h)).json()["data"]
    assert [v["kind"] for v in versions] == ["DoRA"]

    r = await client.post("/v1/completions", headers=h, json={
        "model": "dora1", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(env.model_dir)
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        want = peft_reference(env.model_dir, folder).generate(ids, max_new_tokens=5, do_sample=False)
    assert r.json()["choices"][0]["text"] == tok.decode(want[0, ids.shape[1]:])

    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    rows = (await client.get("/admin/adapters", headers=admin)).json()["data"]
    assert {row["kind"] for row in rows if row.get("adapter") == "dora1"} == {"DoRA"}
    assert (await client.post("/admin/login", data={"key": ADMIN_KEY})).status_code == 303
    page = (await client.get("/admin/ui/adapters?tenant=alpha")).text.split('<table id="adapters">', 1)[1]
    row = page.split("<b>dora1</b>", 1)[1].split("</tr>", 1)[0]
    assert "<td>DoRA</td>" in row and "<td>DoRA</td>" not in page.split("<b>a-only</b>", 1)[1].split("</tr>", 1)[0]
    assert (await client.delete("/v1/adapters/dora1", headers=h)).status_code == 200


async def test_trainable_tokens_upload_says_its_kind_and_serves(client, env, tmp_path):
    """A PEFT adapter with trainable tokens uploads as ``kind: LoRA+tokens``, serves greedy tokens
    equal to PEFT's (the prompt's tokens re-embedded; on the tied base their logits too), and the
    dashboard shows its kind."""
    import torch
    from support.lora_fixtures import make_peft_adapter, peft_reference
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(env.model_dir)
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    folder = make_peft_adapter(env.model_dir, tmp_path / "tokens", r=4, std=0.2, target_modules=["q_proj"],
                               trainable_token_indices=sorted(set(ids[0].tolist())))
    h = env.headers(env.key_a)
    r = await client.post("/v1/adapters", files=_files(folder), headers=h, data={"name": "tok1"})
    assert r.status_code == 201, r.text
    assert r.json()["kind"] == "LoRA+tokens"
    r = await client.post("/v1/completions", headers=h, json={
        "model": "tok1", "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    with torch.no_grad():
        want = peft_reference(env.model_dir, folder).generate(ids, max_new_tokens=5, do_sample=False)
    assert r.json()["choices"][0]["text"] == tok.decode(want[0, ids.shape[1]:])
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    rows = (await client.get("/admin/adapters", headers=admin)).json()["data"]
    assert {row["kind"] for row in rows if row.get("adapter") == "tok1"} == {"LoRA+tokens"}
