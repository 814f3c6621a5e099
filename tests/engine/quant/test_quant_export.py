"""``merge_and_unload`` export over a quantized base: the adapter merges into the dequantized
weights, the export is a plain float checkpoint (no ``quantization_config``) and says so, and
its logits are PEFT's base + adapter on the dequantized base."""

from __future__ import annotations

import json
import logging

from support.lora_fixtures import make_peft_adapter
from support.quant_checkpoints import write_compressed
from support.tiny_models import make_tiny_model

from loramux.adapters.merge import export_merged


def test_export_merges_into_the_dequantized_base(tmp_path, default_model_dir, caplog):
    src = make_tiny_model(tmp_path / "float", default_model_dir, "llama")
    folder = write_compressed(src, tmp_path / "quant", num_bits=4, group_size=32)
    adapter = make_peft_adapter(src, tmp_path / "a", r=4, std=0.1)
    with caplog.at_level(logging.WARNING, logger="loramux.adapters.merge"):
        out = export_merged(folder, adapter, tmp_path / "merged", check=True, progress=False)
    assert "merges into its dequantized weights" in caplog.text
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    meta = json.loads((out / "loramux_export.json").read_text())
    assert meta["base_quantization"]["quant_method"] == "compressed-tensors"
    assert meta["base_quantization"]["merged_into"] == "dequantized weights"
