"""A numerically poisoned adapter (finite, ``lora_B`` × 1e30): refused at upload by the
probe; one forced in past the probe (a test hook) fails its own request with 500
``adapter_numerics`` and nobody else's, and is refused (422) until replaced."""

from __future__ import annotations

import httpx
import pytest
from safetensors.torch import load_file, save_file
from support.adapters import write_random_adapter

from loramux.adapters.errors import AdapterValidationError


def _poisoned(tiny_model_dir, path):
    out = write_random_adapter(tiny_model_dir, path, seed=5, std=0.3)
    weights = out / "adapter_model.safetensors"
    save_file({k: v * 1e30 if "lora_B" in k else v for k, v in load_file(weights).items()}, weights)
    return out


def _complete(url, key, model, prompt="hello"):
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})


@pytest.mark.latency
def test_poisoned_adapter_refused_at_upload_and_isolated_when_forced_in(
        live, tenants, tiny_model_dir, tmp_path, monkeypatch):
    bad = _poisoned(tiny_model_dir, tmp_path / "poison")
    with pytest.raises(AdapterValidationError, match="overflows"):
        tenants.registry.upload(tenants.attacker.id, "poison", bad)

    import loramux.adapters.probe as probe

    monkeypatch.setattr(probe, "probe_adapter", lambda weights, dtype=None: None)  # the hook
    tenants.registry.upload(tenants.attacker.id, "poison-forced", bad)
    monkeypatch.undo()

    url, canary = live()
    before = _complete(url, tenants.neighbour_key, "neighbour-lora")
    assert before.status_code == 200
    r = _complete(url, tenants.attacker_key, "poison-forced")
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "adapter_numerics" and "poison-forced" in err["message"], err
    after = _complete(url, tenants.neighbour_key, "neighbour-lora")
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    canary.check()
    again = _complete(url, tenants.attacker_key, "poison-forced")
    assert again.status_code == 422 and "marked broken" in again.text, again.text
    assert _complete(url, tenants.attacker_key, "attacker-lora").status_code == 200
