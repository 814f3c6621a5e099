"""Fixtures of the parser tests: the default model's tokenizer, with and without a
format's special tokens (helpers that replay streams are in parser_replay.py)."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def make_tokenizer(default_model_dir):
    """``make_tokenizer(*special_tokens)``: the default model's tokenizer (SmolLM2's,
    which has none of the formats' markers), with ``special_tokens`` added."""
    from transformers import AutoTokenizer

    cache: dict[tuple[str, ...], Any] = {}

    def make(*special_tokens: str):
        if special_tokens not in cache:
            tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
            if special_tokens:
                tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
            cache[special_tokens] = tokenizer
        return cache[special_tokens]

    return make


@pytest.fixture(scope="session")
def plain_tokenizer(make_tokenizer):
    return make_tokenizer()
