"""What a quantized base costs and how the server says so: the projections' bytes are the stored
(packed) bytes, the engine reports the format the admin overview shows, a float base reads
``float``."""

from __future__ import annotations

from support.quant_checkpoints import write_compressed
from support.tiny_models import make_tiny_model

from loramux.engine import LLM
from loramux.engine.async_engine import AsyncEngine


def _projection_bytes(model) -> int:
    return sum(x.nbytes for w in model.layers for x in (w.qkv, w.o, *w.mlp.linears))


def test_weight_bytes_and_format_of_a_quantized_base(tmp_path, default_model_dir):
    src = make_tiny_model(tmp_path / "float", default_model_dir, "llama")
    folder = write_compressed(src, tmp_path / "quant", num_bits=4, group_size=32)
    engines = []
    try:
        for path in (src, folder):
            engines.append(AsyncEngine(LLM(str(path), dtype="float32", device="cpu", max_model_len=64).llm_engine))
        dense, packed = engines
        assert dense.weight_format == "float"
        assert packed.weight_format.startswith("compressed-tensors") and "int4 group 32" in packed.weight_format
        # int4 values (+ one fp32 scale per 32) take well under a quarter of fp32's bytes
        assert _projection_bytes(packed.engine.model) < _projection_bytes(dense.engine.model) / 4
        assert packed.weight_bytes < dense.weight_bytes
    finally:
        for e in engines:
            e.shutdown()
