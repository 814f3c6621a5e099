"""An activated LoRA's request is routed by the base model's prefix hashes (its context before
the invocation is the base's KV on the engine); a plain LoRA's by its own."""

from __future__ import annotations

import json

from support.adapters import write_random_adapter
from support.server import make_registry

from loramux.platform.cluster.gateway import Gateway
from loramux.platform.cluster.routing import prefix_hashes
from loramux.platform.identity import Caller


async def test_alora_prefixes_are_the_bases(tiny_model_dir, tmp_path):
    registry = make_registry(tmp_path / "reg", tiny_model_dir, max_lora_rank=16)
    tenant, _ = registry.create_tenant("acme")
    plain = write_random_adapter(tiny_model_dir, tmp_path / "plain", seed=1)
    alora = write_random_adapter(tiny_model_dir, tmp_path / "alora", seed=2)
    cfg = json.loads((alora / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = [5, 6]
    (alora / "adapter_config.json").write_text(json.dumps(cfg))
    registry.upload(tenant.id, "plain", plain)
    registry.upload(tenant.id, "checker", alora)
    gw = Gateway(registry, None, None, None, None, None, "s", "g", resolve_ttl=60, quota_ttl=60)
    caller = Caller(tenant=tenant)
    text = "a long shared conversation " * 40
    a_key, _ = await gw.resolve(caller, "checker")
    p_key, _ = await gw.resolve(caller, "plain")
    assert gw.prefix_owner(a_key) is None and gw.prefix_owner(None) is None
    assert gw.prefix_owner(p_key) == p_key
    assert prefix_hashes(gw.prefix_owner(a_key), text) == prefix_hashes(None, text)
    assert prefix_hashes(gw.prefix_owner(p_key), text) != prefix_hashes(None, text)
    registry.db.dispose()
