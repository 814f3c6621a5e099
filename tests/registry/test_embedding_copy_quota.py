"""The tenant quota ``max_embedding_copy_bytes`` (``adapters/full_copies.py``): an upload whose
full copy of an embedding layer differs from the served base is refused under the default 0,
naming the size and the quota, with nothing stored; under a quota that holds it the upload keeps
the copy (PEFT loads it) and drops a copy equal to the base (stored once: the base's)."""

from __future__ import annotations

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from support.lora_fixtures import make_peft_adapter
from support.tiny_models import make_tiny_llama

from loramux.adapters.errors import AdapterValidationError
from loramux.registry import Quotas, build_registry

HEAD = "base_model.model.lm_head.base_layer.weight"
EMB = "base_model.model.model.embed_tokens.base_layer.weight"


@pytest.fixture
def served(tmp_path, default_model_dir):
    base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=False)
    reg = build_registry(database_url=f"sqlite:///{tmp_path / 'r.db'}", data_dir=tmp_path / "data",
                         base_model=str(base), base_model_name="tiny", max_lora_rank=16, auto_upgrade=True)
    yield base, reg
    reg.db.dispose()


def test_copies_past_the_quota_refused_and_within_it_kept(served, tmp_path):
    base, reg = served
    reg.create_tenant("acme")
    a = make_peft_adapter(base, tmp_path / "a", target_modules=["embed_tokens", "lm_head", "q_proj"])
    sd = load_file(a / "adapter_model.safetensors")
    sd[HEAD][[3, 9]] += 0.5
    save_file(sd, str(a / "adapter_model.safetensors"))
    hidden = sd[HEAD].shape[1]
    with pytest.raises(AdapterValidationError, match=f"{2 * hidden * 4} bytes.*quota of 0") as e:
        reg.upload("acme", "copy", a)
    assert e.value.field == HEAD and reg.list("acme") == []
    reg.set_quotas("acme", Quotas(max_embedding_copy_bytes=2 * hidden * 4))
    handle = reg.upload("acme", "copy", a)
    assert handle.kind == "LoRA+embedding"
    with safe_open(str(handle.local_path() / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    assert HEAD in keys and EMB not in keys  # the differing copy kept, the equal one dropped
