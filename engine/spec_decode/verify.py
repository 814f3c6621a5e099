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
from typing import Protocol

import torch

from loramux.engine.sequence import Sequence
from loramux.engine.step_data import ModelOutput


@dataclass
class Verified:
    """One verify row's result."""

    seq: Sequence
    num_drafted: int
    num_accepted: int = 0


class RowSampler(Protocol):
    """What verification asks of the sample phase (the ``OutputProcessor``)."""

    vocab_size: int

    def sample_rows(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence],
                    bad: dict[str, Exception]) -> list[Sequence]:
        """Sample and postprocess one token for each of ``seqs`` from row ``rows[i]`` of
        ``logits``; failures land in ``bad``. Returns the sequences that took a token."""

    def accept_pick(self, seq: Sequence, token: int) -> None:
        """Postprocess ``token`` for ``seq`` (it may stop); raises on a failure."""


def plain_greedy(seq: Sequence) -> bool:
    """True when every position's token is the argmax of the row's raw logits whatever came
    before it: greedy, no grammar (not even one waiting for the end of a thought: its mask
    starts mid-row, so such a row is verified position by position), nothing the sampler
    would apply to the logits (allowed tokens, a pending ``min_tokens``, ``logit_bias``,
    penalties) and no logprobs (nor a ``best_of`` ranking by them)."""
    p = seq.params
    return (p.is_greedy and seq.grammar is None and p.allowed_token_ids is None
            and not p.logit_bias and seq.num_output_tokens >= p.min_tokens
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and p.logprobs is None and p.best_of <= p.n)


def verify_drafts(outputs: RowSampler, output: ModelOutput, rows: list[int],
                  seqs: list[Sequence], bad: dict[str, Exception]) -> list[Verified]:
    """Accept drafts for the verify rows ``rows`` (indexes into ``output.rows``; ``seqs[i]``
    is row ``rows[i]``'s sequence). Appends the accepted drafts and the one token sampled after
    them to each sequence (postprocessed: it may finish); a failing row lands in ``bad``.
    Returns the rows' results, failed ones left out.

    A :func:`plain_greedy` row takes one argmax over all its positions and postprocesses its
    tokens up to the first rejected draft (the sampler would pick the same tokens: nothing it
    does depends on the tokens before); the others are sampled position by position, every
    live row of a position in one sampler call, so a step's verification costs what its
    drafted tokens cost, not a sampler call per row and position."""
    results: list[Verified] = []
    todo: list[tuple[Verified, int, list[int]]] = []
    vocab = outputs.vocab_size
    for i, seq in zip(rows, seqs, strict=True):
        row = output.rows[i]
        v = Verified(seq, row.num_draft_tokens)
        results.append(v)
        drafts = row.token_ids[1:]
        if seq.request_id in bad:  # a sibling (n > 1) failed the request
            continue
        if plain_greedy(seq):
            draft_logits = output.draft_logits[i][:, :vocab]  # [k, V]
            picks = torch.cat([draft_logits.argmax(dim=-1),
                               output.logits[i, :vocab].argmax(dim=-1, keepdim=True)]).tolist()
            _accept_greedy(outputs, v, picks, drafts, bad)
        else:
            todo.append((v, i, drafts))
    _verify_sampled(outputs, output, todo, bad)
    return [v for v in results if v.seq.request_id not in bad]


def _accept_greedy(outputs: RowSampler, v: Verified, picks: list[int], drafts: list[int],
                   bad: dict[str, Exception]) -> None:
    """Postprocess ``picks`` (the argmax of each position) while they match the drafts."""
    seq = v.seq
    for pos, token in enumerate(picks):
        try:
            outputs.accept_pick(seq, token)
        except Exception as exc:
            bad[seq.request_id] = exc
            return
        if pos >= len(drafts) or token != drafts[pos]:
            return
        v.num_accepted += 1
        if seq.is_stopped:
            return


def _verify_sampled(outputs: RowSampler, output: ModelOutput,
                    todo: list[tuple[Verified, int, list[int]]], bad: dict[str, Exception]) -> None:
    """Position by position through the sampler, for the rows ``todo`` ((result, row, drafts))."""
    live = todo
    pos = 0
    while live:
        live = [item for item in live if item[0].seq.request_id not in bad]
        if not live:
            break
        step_logits = torch.stack([output.draft_logits[i][pos] if pos < len(drafts)
                                   else output.logits[i] for _, i, drafts in live])  # [R, V]
        took = {id(s) for s in outputs.sample_rows(step_logits, list(range(len(live))),
                                                   [v.seq for v, _, _ in live], bad)}
        nxt = []
        for v, i, drafts in live:
            seq = v.seq
            if id(seq) not in took or pos >= len(drafts) or seq.token_ids[-1] != drafts[pos]:
                continue
            v.num_accepted += 1
            if not seq.is_stopped:
                nxt.append((v, i, drafts))
        live = nxt
        pos += 1
