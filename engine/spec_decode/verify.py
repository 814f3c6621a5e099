"""Acceptance of a verify row's drafts, exact for greedy and for sampling.

A verify row computed ``[t, d_1 .. d_k]`` (``t`` the sequence's last token, ``d`` the
drafts), so its logits at position ``j`` are the target model's next-token logits given the
context plus ``d_1 .. d_j``. Position by position, the token there is sampled exactly as a
normal decode step would sample it (same sampler, penalties, ``min_tokens``, logprobs,
postprocessing with stop strings and ``max_tokens``, the sequence's own generator), and the
draft is kept while the sampled token equals it. With a draft that has no probabilities
(ngram: a point mass on ``d_j``) this *is* vLLM's rejection sampling: ``d_j`` is accepted
with probability ``p(d_j)``, and on rejection the token comes from ``p`` without ``d_j``
renormalized (the residual ``max(p - q, 0)``); when all ``k`` are accepted the last
position's sample is the bonus token. Greedy outputs are token-identical to no speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loramux.engine.output_processor import OutputProcessor
from loramux.engine.sequence import Sequence
from loramux.engine.step_data import ModelOutput


@dataclass
class Verified:
    """One verify row's result."""

    seq: Sequence
    num_drafted: int
    num_accepted: int = 0


def verify_drafts(outputs: OutputProcessor, output: ModelOutput, rows: list[int],
                  seqs: list[Sequence], bad: dict[str, Exception]) -> list[Verified]:
    """Accept drafts for the verify rows ``rows`` (indexes into ``output.rows``; ``seqs[i]``
    is row ``rows[i]``'s sequence). Appends the accepted drafts and the one token sampled after
    them to each sequence (postprocessed: it may finish); a failing row lands in ``bad``.
    Returns the rows' results, failed ones left out."""
    logits = output.logits
    todo: list[tuple[Verified, torch.Tensor, list[int]]] = []
    for i, seq in zip(rows, seqs, strict=True):
        row = output.rows[i]
        k = row.num_draft_tokens
        full = torch.cat([output.draft_logits[i], logits[i : i + 1]])  # [k + 1, V]
        todo.append((Verified(seq, k), full, row.token_ids[1:]))
    results = [v for v, _, _ in todo]
    live = todo
    pos = 0
    while live:
        live = [item for item in live if item[0].seq.request_id not in bad]
        if not live:
            break
        step_logits = torch.stack([full[pos] for _, full, _ in live])  # [R, V]
        took = {id(s) for s in outputs.sample(step_logits, list(range(len(live))),
                                              [v.seq for v, _, _ in live], bad)}
        nxt = []
        for v, full, drafts in live:
            seq = v.seq
            if id(seq) not in took or pos >= len(drafts) or seq.token_ids[-1] != drafts[pos]:
                continue
            v.num_accepted += 1
            if not seq.is_finished:
                nxt.append((v, full, drafts))
        live = nxt
        pos += 1
    return [v for v in results if v.seq.request_id not in bad]
