"""Postprocessing of one sampled token (append, logprobs, detokenize, stop checks) and of a
prompt's logits (vLLM's ``prompt_logprobs``)."""

from __future__ import annotations

import torch

from loramux.engine.detokenizer import Detokenizer
from loramux.engine.outputs import Logprob
from loramux.engine.sampler import SamplerOutput
from loramux.engine.sequence import Sequence

LOGPROB_ROWS = 128
"""Prompt positions whose logprobs are computed at once (bounds the [rows, vocab] temporaries)."""


class Postprocessor:
    """Applies a step's picks to sequences and decides when they stop (called by the
    :class:`~loramux.engine.output_processor.OutputProcessor`, engine thread): a stop sets
    ``finish_reason`` / ``stop_reason``, and the scheduler finishes the sequence."""

    def __init__(self, detokenizer: Detokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.detok = detokenizer
        self.eos = eos_token_ids
        self.max_model_len = max_model_len

    def accept(self, seq: Sequence, row: int, out: SamplerOutput) -> None:
        """Append the row's token to ``seq`` and set its ``finish_reason`` when a limit is hit."""
        token = out.token_ids[row]
        seq.append_token(token)
        p = seq.params
        if out.logprobs is not None:
            lp = out.logprobs[row]
            seq.cumulative_logprob += lp
            if p.logprobs is not None:
                entry = {token: Logprob(lp, out.ranks[row], self.detok.token_text(token, seq))}
                for rank, (tid, tlp) in enumerate(
                    zip(out.top_ids[row], out.top_logprobs[row], strict=True), start=1
                ):
                    if tid not in entry:
                        entry[tid] = Logprob(tlp, rank, self.detok.token_text(tid, seq))
                seq.logprobs.append(entry)
        is_eos = token in self.eos and not p.ignore_eos
        new_text = self.detok.decode_token(seq, token) if p.detokenize and not is_eos else ""
        n_out = seq.num_output_tokens
        if n_out < p.min_tokens:  # no stop condition applies before min_tokens
            seq.text += new_text
            if seq.num_tokens >= self.max_model_len:  # the context is full all the same
                self._finish(seq, "length", None)
            return
        if is_eos:
            self._finish(seq, "stop", None)
        elif token in p.stop_token_ids:
            if p.include_stop_str_in_output:
                seq.text += new_text
            self._finish(seq, "stop", token)
        elif self.detok.apply_stop_strings(seq, new_text):
            self._finish(seq, "stop", seq.stop_reason)
        elif p.max_tokens is not None and n_out >= p.max_tokens:
            self._finish(seq, "length", None)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length", None)

    def record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """vLLM's prompt_logprobs: None for the first token, then each prompt token's
        logprob (with rank) and the top-N at its position. ``logits`` [P - 1, V] (bounded by
        the step's token budget) is read in chunks of ``LOGPROB_ROWS`` rows, so the
        temporaries stay [LOGPROB_ROWS, V] whatever the prompt's length."""
        def text(tid: int) -> str:
            return self.detok.token_text(tid, seq)

        actual_all = torch.tensor(seq.prompt_token_ids[1:])
        n = seq.params.prompt_logprobs
        out: list = [None]
        for lo in range(0, logits.shape[0], LOGPROB_ROWS):
            lp = torch.log_softmax(logits[lo : lo + LOGPROB_ROWS].float(), dim=-1)  # [C, V]
            actual = actual_all[lo : lo + lp.shape[0]]
            chosen = lp.gather(1, actual.unsqueeze(1)).squeeze(1)
            ranks = ((lp > chosen.unsqueeze(1)).sum(dim=1) + 1).tolist()
            top_v, top_i = lp.topk(n, dim=-1) if n > 0 else (lp[:, :0], lp[:, :0].long())
            for j, (tid, val) in enumerate(zip(actual.tolist(), chosen.tolist(), strict=True)):
                entry = {tid: Logprob(val, ranks[j], text(tid))}
                for rank, (t, v) in enumerate(zip(top_i[j].tolist(), top_v[j].tolist(), strict=True), 1):
                    entry.setdefault(t, Logprob(v, rank, text(t)))
                out.append(entry)
        seq.prompt_logprobs = out

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
