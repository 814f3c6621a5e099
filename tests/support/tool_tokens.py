"""A copy of a tiny model whose tokenizer has the marker tokens some parsers need
(``<|python_tag|>``, ``[TOOL_CALLS]``, ``<think>`` …) as added tokens, the embeddings
resized to match, so the parsers' start-up checks pass and a regex can force them."""

from __future__ import annotations

from pathlib import Path

MARKERS = ("<|python_tag|>", "[TOOL_CALLS]", "<think>", "</think>")


def with_marker_tokens(model_dir: Path, out_dir: Path, markers=MARKERS) -> Path:
    """``out_dir`` holding ``model_dir``'s model with ``markers`` added (not special: a
    grammar matches them by their text) and rows for them in the embeddings."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.add_tokens(list(markers))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir
