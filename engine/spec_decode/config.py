"""``--speculative-config`` / ``LLM(speculative_config=...)``: vLLM's keys, validated."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_SPECULATIVE_TOKENS = 16
"""Most drafted tokens per row and step (a verify row computes 1 + k tokens)."""
MAX_LOOKUP = 64
"""Longest n-gram ``prompt_lookup_max`` may ask to match."""
_METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass
class SpeculativeConfig:
    """Prompt-lookup (ngram) speculative decoding, with vLLM's option names."""

    method: str = "ngram"
    """Only ``ngram`` (drafts from the sequence's own prompt and output)."""
    num_speculative_tokens: int = 0
    """Tokens drafted per row and step (1..MAX_SPECULATIVE_TOKENS); required."""
    prompt_lookup_max: int | None = None
    """Longest n-gram matched; None = ``prompt_lookup_min`` (both None: 5, as vLLM)."""
    prompt_lookup_min: int | None = None
    """Shortest n-gram matched; None = ``prompt_lookup_max``."""

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(_METHODS)}, got "
                             f"{self.method!r} (draft models, EAGLE, Medusa and MTP are not served)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LOOKUP):
                raise ValueError(f"speculative_config.{name} must be an integer in [1, {MAX_LOOKUP}], "
                                 f"got {v!r}")
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The config of a JSON string or dict (vLLM's ``--speculative-config``); None or an
        empty string = off. Unknown keys and bad values raise ``ValueError`` naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {list(_KEYS)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens")
        given: dict[str, Any] = dict(value)
        return cls(**given)
