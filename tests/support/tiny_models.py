"""Tiny random Llama-family models with the default tokenizer, for fast tests."""

from __future__ import annotations

from pathlib import Path


def make_tiny_llama(
    path: Path,
    tokenizer_dir: Path,
    *,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a tiny random Llama-family model (safetensors + the default tokenizer) to ``path``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    arch = overrides.pop("architecture", "llama")
    cfg.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    elif arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(**cfg))
    else:
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
