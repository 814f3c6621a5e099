"""A request: its prompt, its sequences (``best_of`` of them) and how to report them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loramux.engine.detokenizer import stream_holdback
from loramux.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence


@dataclass(eq=False)
class Request:
    """Engine-side record of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    lora_request: object | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    aborted: bool = False
    error: Exception | None = None
    """Why the engine ended the request early (e.g. its adapter failed to load)."""

    @property
    def finished(self) -> bool:
        return self.aborted or all(s.is_finished for s in self.seqs)

    def to_output(self, *, streaming: bool = False) -> RequestOutput:
        """Snapshot for the caller; with ``best_of`` > n only the best n once finished."""
        finished = self.finished
        seqs = self.seqs
        if self.params.best_of > self.params.n:
            if not finished:
                seqs = []
            else:
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: self.params.n]
        outs = []
        for i, s in enumerate(seqs):
            hold = stream_holdback(s) if streaming else 0
            text = s.text[: len(s.text) - hold] if hold else s.text
            outs.append(
                CompletionOutput(
                    index=i if self.params.best_of > self.params.n else s.index,
                    text=text,
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if self.params.logprobs is not None else None,
                    logprobs=list(s.logprobs) if self.params.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    lora_request=self.lora_request,
                )
            )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.seqs[0].prompt_logprobs if self.seqs else None,
            outputs=outs,
            finished=finished,
            metrics=self.metrics,
            lora_request=self.lora_request,
            num_cached_tokens=(self.seqs[0].num_cached_tokens or 0) if self.seqs else 0,
            extra={"error": self.error} if self.error is not None else {},
        )
