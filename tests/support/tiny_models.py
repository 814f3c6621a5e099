"""Tiny random models of every family with the default tokenizer, for fast tests."""

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


FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=24, sliding_window_pattern=2,
        hidden_activation="gelu_pytorch_tanh", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True,
    )),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=12, attn_logit_softcapping=3.0,
        final_logit_softcapping=6.0, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(tie_word_embeddings=False, hidden_act="silu")),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=True,
    )),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=False,
    )),
}
"""Per family: the model and config classes and what the tiny config sets beyond the shared dims."""


SHARP_STD = {"q_proj": 0.3, "k_proj": 0.3, "v_proj": 0.2, "qkv_proj": 0.3, "o_proj": 0.2, "embed_tokens": 0.3,
             "lm_head": 0.3, "gate": 0.5}
"""Init stds that make a tiny model's attention sharp and its logits spread, so that positions,
windows and rotary details change its outputs (with 0.08 everywhere they hardly do)."""


def make_tiny_model(
    path: Path, tokenizer_dir: Path, family: str, *, seed: int = 0, num_hidden_layers: int = 2,
    std: dict[str, float] | None = None, **overrides,
) -> Path:
    """Write a tiny random model of ``family`` (``qwen3``, ``gemma3``, ``gemma3-mm`` (a
    ``Gemma3ForConditionalGeneration`` with a tiny vision tower), ``phi3``; ``llama``, ``qwen2``,
    ``mistral`` go to :func:`make_tiny_llama`) with the default tokenizer, as safetensors.
    Weights are N(0, 0.08) except those named in ``std`` (default :data:`SHARP_STD`)."""
    if family in ("llama", "qwen2", "mistral"):
        return make_tiny_llama(path, tokenizer_dir, seed=seed, architecture=family,
                               num_hidden_layers=num_hidden_layers, **overrides)
    std = SHARP_STD if std is None else std
    import torch
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    multimodal = family == "gemma3-mm"
    arch, config_name, extra = FAMILY_CONFIGS["gemma3" if multimodal else family]
    cfg = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_hidden_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
    )
    cfg.update(extra)
    cfg.update(overrides)
    torch.manual_seed(seed)
    if multimodal:
        from transformers import Gemma3Config, Gemma3ForConditionalGeneration

        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=28, patch_size=14)
        text = {k: v for k, v in cfg.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              image_token_index=len(tok) - 1, boi_token_index=len(tok) - 2,
                              eoi_token_index=len(tok) - 3, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=0)
        model = Gemma3ForConditionalGeneration(config)
    else:
        model = getattr(transformers, arch)(getattr(transformers, config_name)(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, next((s for k, s in std.items() if f"{k}." in name), 0.08))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
