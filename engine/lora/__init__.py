"""LoRA support for the engine: per-step batch metadata and the shrink/expand kernels.

``loramux.engine.lora.meta`` holds :class:`LoRABatchMeta` (built once per engine step);
``loramux.engine.lora.ops`` holds ``lora_shrink`` / ``lora_expand`` / ``add_lora`` with a
pure-torch backend (CPU default and test reference) and a Triton backend (GPU).
"""
