"""Activated LoRA (PEFT's aLoRA, ``alora_invocation_tokens``): the config field and where an
adapter starts in a prompt.

An aLoRA adapter applies from the *last* occurrence of its invocation sequence in the prompt
on (the invocation's own tokens included, and every generated token after the prompt); every
position before it is the base model's, so its keys and values are the base's too. A prompt
without the invocation is the base model's throughout. This is PEFT's
``calculate_alora_offsets`` (which counts the same position back from the end of the input)
and its ``ALoraLinearVariant.forward``. Generated tokens never move the start: PEFT computes
the offsets once, from the prompt given to ``generate``.

Pure Python: the scheduler's side of the engine imports it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loramux.adapters.errors import AdapterValidationError

__all__ = ["FIELD", "MAX_INVOCATION_TOKENS", "activation_start", "check_vocab", "parse_invocation"]

FIELD = "alora_invocation_tokens"
MAX_INVOCATION_TOKENS = 256
"""The longest invocation sequence accepted (each prompt is searched for it)."""


def _refuse(message: str) -> AdapterValidationError:
    return AdapterValidationError(f"{FIELD}: {message}", field=FIELD)


def parse_invocation(config: Mapping[str, Any], vocab_size: int | None = None) -> tuple[int, ...] | None:
    """The config's invocation token ids (None: not an aLoRA adapter). Refuses, naming the
    field, anything but a non-empty list of at most :data:`MAX_INVOCATION_TOKENS` token ids
    (in ``[0, vocab_size)`` when the vocabulary is known), and the combinations PEFT has no
    aLoRA variant for (DoRA, expert parameters)."""
    value = config.get(FIELD)
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not value:
        raise _refuse(f"expected a non-empty list of token ids, got {value!r:.80}")
    if len(value) > MAX_INVOCATION_TOKENS:
        raise _refuse(f"{len(value)} tokens, above the limit of {MAX_INVOCATION_TOKENS}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        bad = next(t for t in value if isinstance(t, bool) or not isinstance(t, int) or t < 0)
        raise _refuse(f"token ids must be non-negative integers, got {bad!r:.40}")
    tokens = tuple(value)
    if vocab_size:
        check_vocab(tokens, vocab_size)
    if config.get("use_dora"):
        raise _refuse("an activated LoRA cannot be a DoRA adapter (use_dora): PEFT has no such variant")
    if config.get("target_parameters"):
        raise _refuse("an activated LoRA on expert parameters (target_parameters) is not supported: "
                      "PEFT applies aLoRA to linear modules only")
    return tokens


def check_vocab(tokens: Sequence[int], vocab_size: int) -> None:
    """Refuse invocation token ids outside the base model's vocabulary."""
    bad = [t for t in tokens if t >= vocab_size]
    if bad:
        raise _refuse(f"token id {bad[0]} is outside the base model's vocabulary of {vocab_size}")


def activation_start(prompt: Sequence[int], invocation: Sequence[int] | None) -> int | None:
    """The prompt position where an aLoRA adapter starts: that of the last occurrence of
    ``invocation`` in ``prompt`` (None: it does not occur, the request is the base model's).
    A plain LoRA (``invocation`` None) starts at 0."""
    if invocation is None:
        return 0
    n = len(invocation)
    first = invocation[0]
    want = list(invocation)
    for i in range(len(prompt) - n, -1, -1):
        if prompt[i] == first and list(prompt[i:i + n]) == want:
            return i
    return None
