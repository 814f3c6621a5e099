"""The third phase of an engine step: turn the model's output into request progress.

:meth:`OutputProcessor.update_from_output` takes the plan and what
``LLMEngine.execute`` returned and, row by row, records prompt logprobs, advances the
computed tokens, forks ``n``/``best_of`` siblings once their prompt is computed,
samples, detokenizes and checks stop conditions. A row fails only its own request:
a sampler or postprocessing error ends that request with :class:`EngineStepError`, and
a row whose logits are not finite (NaN/Inf: the hidden state overflowed) ends it with
:class:`AdapterNumericsError` naming the adapter, which is marked broken (evicted, its
other requests failed, refused until replaced). The other rows of the step go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loramux.engine.errors import AdapterNumericsError, EngineStepError
from loramux.engine.runner import StepBatch
from loramux.engine.scheduler import SchedulerOutput
from loramux.engine.sequence import Sequence

if TYPE_CHECKING:
    from loramux.engine.engine import LLMEngine
    from loramux.engine.request import Request

logger = logging.getLogger(__name__)

LOGPROB_ROWS = 128
"""Prompt positions whose logprobs are computed at once (bounds the [rows, vocab] temporaries)."""


@dataclass
class ModelOutput:
    """What the execute phase returns: the batch and its logits, or the batch-level error."""

    batch: StepBatch | None
    logits: torch.Tensor | None = None
    """[B, V] fp32, row i for ``batch.seqs[i]``'s last token of the step."""
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """row -> [P - 1, V] logits of the prompt positions (prompt logprobs)."""
    error: Exception | None = None
    """Set when the step failed as a whole (e.g. an allocation): its requests fail."""


def nonfinite_rows(out: ModelOutput) -> set[int]:
    """Rows of the batch whose logits (or prompt logits) hold a NaN or an Inf."""
    bad = set()
    if out.logits is not None and out.logits.numel():
        bad.update((~torch.isfinite(out.logits).all(dim=1)).nonzero().flatten().tolist())
    for row, rows in out.prompt_logits.items():
        if not bool(torch.isfinite(rows).all()):
            bad.add(row)
    return bad


class OutputProcessor:
    """Applies a step's model output to its requests (engine thread only)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def update_from_output(self, plan: SchedulerOutput, out: ModelOutput) -> list[Request]:
        """Advance every request of the step; returns those that changed (finished, failed
        or got a token). A batch-level error fails the step's requests."""
        eng = self.engine
        if out.error is not None:
            return self.fail_requests({s.seq.request_id: out.error for s in plan.scheduled})
        batch = out.batch
        touched: dict[str, Request] = {}
        bad: dict[str, Exception] = {}
        for row in sorted(nonfinite_rows(out)):
            seq = batch.seqs[row]
            bad.setdefault(seq.request_id, self._numerics(seq))
        for row, rows in out.prompt_logits.items():
            seq = batch.seqs[row]
            if seq.request_id in bad:
                continue
            try:
                self._record_prompt_logprobs(seq, rows)
            except Exception as exc:
                bad[seq.request_id] = exc
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.request_id in bad:
                continue
            seq.num_computed_tokens += n
            eng.kv.register_computed(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prompt chunk: nothing to sample yet
            sample_rows.append(row)
            sample_seqs.append(seq)
            for child in seq.pending_forks:
                eng.kv.fork(seq, child)
                eng.scheduler.add_fork(child)
                sample_rows.append(row)
                sample_seqs.append(child)
            seq.pending_forks = []
        if sample_rows:
            self._sample_and_accept(out.logits[sample_rows], sample_seqs, touched, bad)
        for req in self.fail_requests(bad):
            touched[req.request_id] = req
        now = time.monotonic()
        for req in touched.values():
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.finished:
                req.metrics.finished_time = now
                eng.requests.pop(req.request_id, None)
        return list(touched.values())

    # --- rows ---------------------------------------------------------------------------
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
        self.engine.lora_manager.mark_broken(key, err)
        return err

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        eng = self.engine
        grammars = [s.grammar for s in seqs]
        if any(g is not None for g in grammars):
            logits = eng.structured.apply(logits, grammars)
        return eng.sampler(logits, seqs)

    def _sample_and_accept(self, logits: torch.Tensor, seqs: list[Sequence], touched: dict,
                           bad: dict[str, Exception]) -> None:
        """Sample one token for each row of ``logits`` (one per sequence) and postprocess it.
        When the batched sampler fails, each row is sampled alone to find the culprits;
        a request whose row fails lands in ``bad``, the others go on."""
        eng = self.engine
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
        for seq, row, sampled in picks:
            if seq.request_id in bad:
                continue
            try:
                if seq.grammar is not None and not seq.grammar.is_terminated():
                    seq.grammar.accept_token(sampled.token_ids[row])
                eng.postprocessor.accept(seq, row, sampled)
            except Exception as exc:
                bad[seq.request_id] = exc
                continue
            if seq.is_finished:
                eng.scheduler.finish(seq)
            touched[seq.request_id] = eng.requests[seq.request_id]

    def fail_requests(self, culprits: dict[str, Exception]) -> list[Request]:
        """End these requests (their blocks freed): an :class:`EngineStepError` as it is,
        anything else wrapped in one that names no internals."""
        eng = self.engine
        out = []
        for rid, exc in culprits.items():
            req = eng.requests.get(rid)
            if req is None:
                continue
            logger.warning("request %s failed in an engine step: %r", rid, exc)
            req.error = exc if isinstance(exc, EngineStepError) else EngineStepError(
                f"the request failed in the engine ({type(exc).__name__}); other requests "
                f"are not affected, retry it or change its parameters"
            )
            eng.abort_request(rid)
            out.append(req)
        return out

    def _record_prompt_logprobs(self, seq: Sequence, logits: torch.Tensor) -> None:
        """vLLM's prompt_logprobs: None for the first token, then each prompt token's
        logprob (with rank) and the top-N at its position. ``logits`` [P - 1, V] (bounded by
        the step's token budget) is read in chunks of ``LOGPROB_ROWS`` rows, so the
        temporaries stay [LOGPROB_ROWS, V] whatever the prompt's length."""
        entry_of = self.engine.logprob_entry
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
                entry = {tid: entry_of(tid, val, ranks[j])}
                for rank, (t, v) in enumerate(zip(top_i[j].tolist(), top_v[j].tolist(), strict=True), 1):
                    entry.setdefault(t, entry_of(t, v, rank))
                out.append(entry)
        seq.prompt_logprobs = out
