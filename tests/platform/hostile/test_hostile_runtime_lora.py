"""vLLM's load API in a tenant's hands: oversized weights (413 under the upload cap), a
FIFO where the weights should be (never blocks: 400), symlinks and paths outside the
allow-list (400), and a load/unload churn, all beside the neighbour's canary, whose
latency and greedy output are asserted."""

from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

MAX_UPLOAD = 2 * 1024 * 1024


def _greedy(url: str, key: str) -> str:
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "neighbour-lora", "prompt": "the canary says", "max_tokens": 8,
                         "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.latency
def test_runtime_lora_abuse_beside_the_canary(live, tenants, tmp_path):
    root = tmp_path / "loras"
    mine = root / "attacker"
    mine.mkdir(parents=True)
    shutil.copytree(tenants.adapter_dirs[2], mine / "good")
    big = mine / "big"
    shutil.copytree(tenants.adapter_dirs[2], big)
    with open(big / "adapter_model.safetensors", "r+b") as f:
        f.truncate(MAX_UPLOAD * 50)  # sparse: 100 MB on paper
    fifo = mine / "fifo"
    fifo.mkdir()
    shutil.copy(tenants.adapter_dirs[2] / "adapter_config.json", fifo)
    os.mkfifo(fifo / "adapter_model.safetensors")
    os.mkfifo(mine / "pipe.tar.gz")
    (root / "neighbour").mkdir()
    shutil.copytree(tenants.adapter_dirs[1], root / "neighbour" / "private")
    url, canary = live(allow_runtime_lora_updating=True, max_upload_bytes=MAX_UPLOAD,
                       lora_path_allow=[str(root / "{tenant}")])
    expected = _greedy(url, tenants.neighbour_key)
    h = {"Authorization": f"Bearer {tenants.attacker_key}"}

    def load(name: str, path: str) -> httpx.Response:
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/load_lora_adapter", headers=h, timeout=30,
                       json={"lora_name": name, "lora_path": path})
        assert time.monotonic() - start < 10, "a load must fail fast"
        return r

    with canary.beside():
        for _ in range(3):
            assert load("big", str(big)).status_code == 413
            assert load("fifo", str(fifo)).status_code == 400
            assert load("pipe", str(mine / "pipe.tar.gz")).status_code == 400
            assert load("steal", str(root / "neighbour" / "private")).status_code == 400
            assert load("up", str(mine / ".." / "neighbour" / "private")).status_code == 400
            assert load("x" * 129, str(mine / "good")).status_code == 400
        for i in range(5):  # churn: each load is a full upload and validation
            assert load("churn", str(mine / "good")).status_code == 200
            r = httpx.post(f"{url}/v1/unload_lora_adapter", headers=h, timeout=30,
                           json={"lora_name": "churn"})
            assert r.status_code == 200, (i, r.text)
        assert _greedy(url, tenants.neighbour_key) == expected
    assert _greedy(url, tenants.neighbour_key) == expected
    names = {a["id"] for a in httpx.get(f"{url}/v1/adapters", headers=h).json()["data"]}
    assert names == {"attacker-lora"}  # nothing half-loaded is left behind
