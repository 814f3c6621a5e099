"""Logprobs in the OpenAI shapes: completions (tokens, token_logprobs, top_logprobs,
text_offset), chat (content entries with bytes and top_logprobs) and vLLM's
prompt_logprobs. Token texts are decoded once per token id and cached."""

from __future__ import annotations

import math

from loramux.engine.outputs import RequestOutput


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


class TokenRenderer:
    """Token ids to text and logprob entries, for one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.tokenizer.convert_ids_to_tokens(token_id)
            text = self.tokenizer.convert_tokens_to_string([tok]) if tok is not None else ""
            self._token_text[token_id] = text
        return text

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's shape: None for the first prompt token, then token id -> logprob, rank, text."""
        if out.prompt_logprobs is None:
            return None
        return [
            None if entry is None else {
                str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                         "decoded_token": self.token_text(t)}
                for t, lp in entry.items()
            }
            for entry in out.prompt_logprobs
        ]

    def completion_logprobs(self, token_ids: list[int], logprobs, offset: int) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs, strict=False):
            text = self.token_text(tid)
            tokens.append(text)
            if entry is None:  # the first prompt token has no logprob
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(_finite(entry[tid].logprob) if tid in entry else None)
                tops.append({self.token_text(t): _finite(lp.logprob) for t, lp in entry.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def chat_logprobs(self, token_ids: list[int], logprobs, n_top: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, logprobs, strict=False):
            text = self.token_text(tid)
            chosen = entry.get(tid)
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= n_top),
                key=lambda x: x[1].rank,
            )
            top = [
                {"token": self.token_text(t), "logprob": _finite(lp.logprob),
                 "bytes": list(self.token_text(t).encode("utf-8"))}
                for t, lp in ranked[:n_top]
            ]
            content.append({
                "token": text,
                "logprob": _finite(chosen.logprob) if chosen is not None else -9999.0,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": top,
            })
        return {"content": content, "refusal": None}
