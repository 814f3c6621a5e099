"""A tiny random Llama with a padded vocabulary (config vocab_size > its tokenizer, as Qwen's)
and a PEFT adapter that adds tokens of its own: ``trainable_token_indices`` on the new ids, its
tokenizer (``add_tokens`` and ``add_tokens(..., special_tokens=True)``) saved next to it."""

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
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_tokens([TOOL])
    tok.add_tokens([SEP], special_tokens=True)
    new = tok.convert_tokens_to_ids([TOOL, SEP])
    assert new == [len(base_tok), len(base_tok) + 1]
    adapter = make_peft_adapter(base, tmp / "adapter", target_modules=["q_proj"],
                                trainable_token_indices=new, std=0.5)
    tok.save_pretrained(adapter)
    return base, adapter, AutoTokenizer.from_pretrained(adapter), base_tok
