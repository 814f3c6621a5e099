"""The sample phase of a step: tokens from the step's logits (between the runner's
``execute`` and :meth:`Scheduler.update_from_output
<loramux.engine.scheduler.Scheduler.update_from_output>`, which reads only the ids).

Given the model output and the sequences of its rows, it checks the numbers, records prompt
logprobs, masks grammars, samples (``n`` / ``best_of`` siblings from their parent's row),
verifies drafts and postprocesses (append, logprobs, detokenize, stop checks: a stop sets
the sequence's ``finish_reason``) through the collaborators it is built with, and returns a
plain-data :class:`~loramux.engine.step_data.SampledOutput`. It knows no queue, KV cache or
request table and never changes a sequence's status. A row fails
only its own request: a sampler or postprocessing error lands in the step's failures, and a
row whose logits are not finite (NaN/Inf: the hidden state overflowed) fails with
:class:`AdapterNumericsError` naming the adapter, which is marked broken (evicted, its other
requests failed, refused until replaced). The other rows of the step go on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from loramux.engine.errors import AdapterNumericsError
from loramux.engine.postprocess import Postprocessor
from loramux.engine.sampler import SamplerOutput
from loramux.engine.sequence import Sequence
from loramux.engine.spec_decode.verify import verify_drafts
from loramux.engine.step_data import ModelOutput, SampledOutput, SampledSeq


class SampleFn(Protocol):
    vocab_size: int

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

    @property
    def vocab_size(self) -> int:
        return self.sampler.vocab_size

    def sample(self, output: ModelOutput, seqs: Mapping[int, Sequence]) -> SampledOutput:
        """The sample phase of a step (engine thread, after the runner's ``execute``):
        ``seqs`` finds each row's sequence by id. A row whose prompt is now computed samples
        its token, and one for each of its pending ``n`` / ``best_of`` siblings; a verify
        row accepts drafts; a prompt chunk's row takes nothing."""
        if output.error is not None:
            return SampledOutput(failed={r.request_id: output.error for r in output.rows},
                                 error=output.error)
        row_seqs = [seqs[r.seq_id] for r in output.rows]
        bad, nonfinite = self.check_rows(output, row_seqs)
        before = {}
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        verify_rows: list[int] = []
        verify_seqs: list[Sequence] = []
        for i, (row, seq) in enumerate(zip(output.rows, row_seqs, strict=True)):
            if row.request_id in bad:
                continue
            if row.num_draft_tokens:
                verify_rows.append(i)
                verify_seqs.append(seq)
                before[seq.seq_id] = seq.num_tokens
            elif row.num_computed_tokens + row.num_new_tokens >= seq.num_tokens:
                sample_rows.extend([i] * (1 + len(seq.pending_forks)))
                sample_seqs.extend([seq, *seq.pending_forks])
                before.update((s.seq_id, s.num_tokens) for s in (seq, *seq.pending_forks))
        took = []
        if sample_rows:
            took += [self._took(s, before[s.seq_id])
                     for s in self.sample_rows(output.logits, sample_rows, sample_seqs, bad)]
        if verify_rows:
            took += [self._took(v.seq, before[v.seq.seq_id], v.num_drafted, v.num_accepted)
                     for v in verify_drafts(self, output, verify_rows, verify_seqs, bad)]
        return SampledOutput(took, bad, nonfinite)

    @staticmethod
    def _took(seq: Sequence, num_tokens_before: int, drafted: int = 0, accepted: int = 0) -> SampledSeq:
        return SampledSeq(seq.seq_id, seq.token_ids[num_tokens_before:], seq.finish_reason,
                          drafted, accepted)

    def check_rows(self, out: ModelOutput, seqs: list[Sequence]) -> tuple[dict[str, Exception], list[int]]:
        """Called first on a step's output (``seqs[i]`` is row i's sequence): fails the
        requests of non-finite rows and records the prompt logprobs of the rows that asked.
        Returns the failed requests (request id -> error) and the non-finite rows."""
        bad: dict[str, Exception] = {}
        nonfinite = sorted(nonfinite_rows(out))
        for row in nonfinite:
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
        return bad, nonfinite

    def accept_pick(self, seq: Sequence, token: int) -> None:
        """Postprocess ``token``, picked outside the sampler (a greedy verify row's argmax)."""
        self.postprocessor.accept(seq, 0, SamplerOutput([token], None, None, None, None))

    def sample_rows(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
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
