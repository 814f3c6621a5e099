"""Incremental detokenization and stop-string handling.

Uses the tokenizers library's ``DecodeStream``, which emits text only once the
bytes of a multi-byte UTF-8 character are complete.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from loramux.engine.adapter_tokenizers import AdapterTokenizers
from loramux.engine.sequence import Sequence

_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token (as vLLM)


def _backend(tokenizer):
    return tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer._tokenizer


class Detokenizer:
    """Turns each new token of a sequence into text and applies stop strings, with the
    sequence's tokenizer (``Sequence.tokenizer``: its adapter's, when the adapter adds tokens
    of its own, :class:`~loramux.engine.adapter_tokenizers.AdapterTokenizers`), else the
    base's. ``tokenizers.get(lora_request)`` gives each request's (``adapter_source``: an
    adapter's folder when its ``LoRARequest`` has no path)."""

    def __init__(self, tokenizer, adapter_source=None, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.tokenizers = AdapterTokenizers(tokenizer, adapter_source, vocab_size)
        self._backend = _backend(tokenizer)

    def decode_token(self, seq: Sequence, token_id: int) -> str:
        """Text that ``token_id`` adds to ``seq`` (may be '' while a character is incomplete)."""
        if seq.detok_state is None:
            # Prompt context: SentencePiece decoders drop the leading space of a first token.
            seq.detok_state = DecodeStream(
                ids=seq.prompt_token_ids[-_PROMPT_CONTEXT:],
                skip_special_tokens=seq.params.skip_special_tokens,
            )
        backend = self._backend if seq.tokenizer is None else _backend(seq.tokenizer)
        piece = seq.detok_state.step(backend, token_id)
        return piece or ""

    def token_text(self, token_id: int, seq: Sequence | None = None) -> str:
        """The text of one token on its own (for logprobs), with ``seq``'s tokenizer."""
        tokenizer = self.tokenizer if seq is None or seq.tokenizer is None else seq.tokenizer
        return tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def apply_stop_strings(seq: Sequence, new_text: str) -> bool:
        """Append ``new_text`` to ``seq.text``; cut at a stop string. True when one matched."""
        stops = seq.params.stop_strings
        before = len(seq.text)
        seq.text += new_text
        if not stops or not new_text:
            return False
        longest = max(len(s) for s in stops)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for s in stops:
            i = seq.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        seq.text = seq.text[: i + len(s)] if seq.params.include_stop_str_in_output else seq.text[:i]
        seq.stop_reason = s
        return True


def stream_holdback(seq: Sequence) -> int:
    """Characters of ``seq.text`` to hold back while streaming: a stop string may still complete."""
    if seq.is_stopped or not seq.params.stop_strings or seq.params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in seq.params.stop_strings) - 1
