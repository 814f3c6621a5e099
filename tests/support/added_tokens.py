"""A tiny random Llama with a padded vocabulary (config vocab_size > its tokenizer, as Qwen's)
and PEFT adapters that add tokens of their own: ``trainable_token_indices`` on the new ids,
their tokenizer (``add_tokens`` and ``add_tokens(..., special_tokens=True)``) saved next to
them."""

from __future__ import annotations

from pathlib import Path

from support.lora_fixtures import make_peft_adapter
from support.tiny_models import make_tiny_llama

TOOL, SEP = "<tool>", "<|sep|>"
"""The adapter's new tokens: a plain one and a special one."""
PROMPT = "Call the tool: <tool> now"


def make_tokens_adapter(tmp: Path, tokenizer_dir: Path):
    """(base folder, adapter folder, the adapter's tokenizer as transformers loads it from
    the adapter's folder, the base's tokenizer)."""
    from transformers import AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = make_tiny_llama(tmp / "base", tokenizer_dir, vocab_size=len(base_tok) + 64)
    adapter, tok = add_tokens_adapter(base, tmp / "adapter", [TOOL], [SEP])
    return base, adapter, tok, base_tok


def add_tokens_adapter(base: Path, out: Path, plain: list[str], special: list[str], seed: int = 0):
    """(adapter folder, its tokenizer): ``plain`` then ``special`` tokens added to the base's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    n = len(tok)
    tok.add_tokens(plain)
    tok.add_tokens(special, special_tokens=True)
    new = tok.convert_tokens_to_ids(plain + special)
    assert new == list(range(n, n + len(new)))
    adapter = make_peft_adapter(base, out, target_modules=["q_proj"], trainable_token_indices=new,
                                std=0.5, seed=seed)
    tok.save_pretrained(adapter)
    return adapter, AutoTokenizer.from_pretrained(adapter)
