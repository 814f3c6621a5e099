"""Tokens from a step's logits: the part of :meth:`Scheduler.update_from_output
<loramux.engine.scheduler.Scheduler.update_from_output>` that reads numbers.

The scheduler hands it the rows' sequences; it checks the numbers, records prompt logprobs,
masks grammars, samples and postprocesses (detokenize, stop checks) through the
collaborators it is built with. It knows no queue, KV cache or request table. A row fails
only its own request: a sampler or postprocessing error lands in the step's failures, and a
row whose logits are not finite (NaN/Inf: the hidden state overflowed) fails with
:class:`AdapterNumericsError` naming the adapter, which is marked broken (evicted, its other
requests failed, refused until replaced). The other rows of the step go on.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loramux.engine.errors import AdapterNumericsError
from loramux.engine.postprocess import Postprocessor
from loramux.engine.sampler import SamplerOutput
from loramux.engine.sequence import Sequence
from loramux.engine.step_data import ModelOutput


class SampleFn(Protocol):
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """One token per row of ``logits`` [B, V] with ``seqs[i]``'s parameters."""


class GrammarMask(Protocol):
    def apply(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """``logits`` with the tokens each row's grammar forbids masked (None = no grammar)."""


class BrokenAdapters(Protocol):
    def mark_broken(self, key: str, error: Exception) -> None:
        """The adapter produced non-finite numbers: evict it and refuse it until replaced."""


def nonfinite_rows(out: ModelOutput) -> set[int]:
    """Rows of the step whose logits (or prompt logits) hold a NaN or an Inf.

    A row's sum is finite only when every value is (NaN and ±Inf propagate); a finite
    sum is one cheap reduction (for prompt and draft logits too: one per row's block), and
    only the rows it flags (rare: an overflowing sum of
    huge finite logits flags one too) are checked value by value."""
    bad = set()
    logits = out.logits
    if logits is not None and logits.numel():
        flagged = (~torch.isfinite(logits.sum(dim=1))).nonzero().flatten()
        if flagged.numel():
            exact = ~torch.isfinite(logits.index_select(0, flagged)).all(dim=1)
            bad.update(flagged[exact].tolist())
    for row, rows in (*out.prompt_logits.items(), *out.draft_logits.items()):
        if not bool(torch.isfinite(rows.sum())) and not bool(torch.isfinite(rows).all()):
            bad.add(row)
    return bad


class OutputProcessor:
    """Checks, samples and postprocesses the rows of a step (engine thread only)."""

    def __init__(
        self,
        sampler: SampleFn,
        postprocessor: Postprocessor,
        structured: GrammarMask,
        adapters: BrokenAdapters,
    ) -> None:
        self.sampler = sampler
        self.postprocessor = postprocessor
        self.structured = structured
        self.adapters = adapters

    def check_rows(self, out: ModelOutput, seqs: list[Sequence]) -> dict[str, Exception]:
        """Called first on a step's output (``seqs[i]`` is row i's sequence): fails the
        requests of non-finite rows and records the prompt logprobs of the rows that asked.
        Returns the failed requests (request id -> error)."""
        bad: dict[str, Exception] = {}
        for row in sorted(nonfinite_rows(out)):
            seq = seqs[row]
            bad.setdefault(seq.request_id, self._numerics(seq))
        for row, rows in out.prompt_logits.items():
            seq = seqs[row]
            if seq.request_id in bad:
                continue
            try:
                self.postprocessor.record_prompt_logprobs(seq, rows)
            except Exception as exc:
                bad[seq.request_id] = exc
        return bad

    def sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
               bad: dict[str, Exception]) -> list[Sequence]:
        """Sample one token for each sequence, ``seqs[i]`` from row ``rows[i]`` of the step's
        ``logits`` [B, V] (forks share their parent's row), and postprocess it. When the
        batched sampler fails, each row is sampled alone to find the culprits; a request
        whose row fails lands in ``bad``, the others go on. Returns the sequences that took a
        token, in order."""
        if rows != list(range(logits.shape[0])):  # prompt chunks sample nothing, forks share rows
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))  # [S, V]
        try:
            picks = [(seq, row, sampled) for sampled in [self._sample(logits, seqs)]
                     for row, seq in enumerate(seqs)]
        except Exception:
            picks = []
            for row, seq in enumerate(seqs):
                try:
                    picks.append((seq, 0, self._sample(logits[row : row + 1], [seq])))
                except Exception as exc:
                    bad[seq.request_id] = exc
        accepted = []
        for seq, row, sampled in picks:
            if seq.request_id in bad:
                continue
            try:
                if seq.grammar is not None and not seq.grammar.is_terminated():
                    seq.grammar.accept_token(sampled.token_ids[row])
                self.postprocessor.accept(seq, row, sampled)
            except Exception as exc:
                bad[seq.request_id] = exc
                continue
            accepted.append(seq)
        return accepted

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        grammars = [s.grammar for s in seqs]
        if any(g is not None for g in grammars):
            logits = self.structured.apply(logits, grammars)
        return self.sampler(logits, seqs)

    def _numerics(self, seq: Sequence) -> AdapterNumericsError:
        """The error of a non-finite row; its adapter (if any) is marked broken."""
        key = seq.lora_key
        if key is None:
            return AdapterNumericsError(
                "the base model produced non-finite numbers (NaN/Inf) for this request; "
                "other requests are not affected", None)
        err = AdapterNumericsError(
            f"adapter {key!r} produced non-finite numbers (NaN/Inf) for this request; it is "
            f"marked broken and refused until it is replaced (upload a new version)", key)
        self.adapters.mark_broken(key, err)
        return err
