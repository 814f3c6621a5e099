"""Structured outputs constrain the answer, not the thought (vLLM's default with a
reasoning parser; ``--structured-outputs-config '{"enable_in_reasoning": true}'``
constrains both).

:func:`gate_after_thought` hands the engine the token ids that close the thought
(``StructuredOutputsParams.reasoning_end``): the row's grammar applies from the token
after them. A prompt whose template already closed the thought (Qwen3 with
``enable_thinking: false``) needs no gate: the grammar applies from the first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from loramux.engine.sampling_params import SamplingParams


def thought_end_ids(tokenizer: Any, end: str) -> list[list[int]]:
    """The token sequences that spell ``end``: its vocabulary token, if it is one, and
    its tokenization alone and after a newline (a marker can merge with what precedes
    it in byte-level vocabularies)."""
    sequences: list[list[int]] = []
    token_id = tokenizer.get_vocab().get(end)
    if token_id is not None:
        sequences.append([token_id])
    plain = list(tokenizer.encode(end, add_special_tokens=False))
    newline = list(tokenizer.encode("\n", add_special_tokens=False))
    after_newline = list(tokenizer.encode("\n" + end, add_special_tokens=False))
    if after_newline[: len(newline)] == newline:
        after_newline = after_newline[len(newline):]
    for seq in (plain, after_newline):
        if seq and seq not in sequences:
            sequences.append(seq)
    return sequences


def gate_after_thought(params: SamplingParams, parsing: Any,
                       prompt_ids: Sequence[int]) -> SamplingParams:
    """``params`` whose output constraint (if any) waits for the end of the thought."""
    spec = params.structured_outputs
    if spec is None or parsing.reasoning_cls is None:
        return params
    reasoner = parsing.new_reasoner()
    end = reasoner.reasoning_end_str
    if not end or reasoner.is_reasoning_end(list(prompt_ids)):
        return params
    gated = dataclasses.replace(spec, reasoning_end=thought_end_ids(parsing.tokenizer, end))
    return params.clone(structured_outputs=gated)
