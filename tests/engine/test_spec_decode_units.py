"""Speculative decoding's parts with no model: the ngram proposer, the drafter's caps and its
switch-off, the scheduler's verify rows and KV trim, and a chi-square test that verified
sampling draws from the target distribution exactly (with and without speculation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.scheduler_harness import (
    VOCAB,
    make_output_processor,
    make_scheduler,
    model_output,
    sample,
)

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence
from loramux.engine.spec_decode.config import SpeculativeConfig
from loramux.engine.spec_decode.drafter import Drafter
from loramux.engine.spec_decode.ngram import TokenBuffer, propose
from loramux.engine.spec_decode.verify import verify_drafts
from loramux.engine.step_data import ModelOutput, ScheduledRow


def test_ngram_proposes_the_continuation_of_the_latest_longest_match():
    ctx = np.array([5, 1, 2, 3, 9, 9, 1, 2, 4, 7, 8, 2, 1, 2])
    # suffix [1, 2] occurs at 1..2 (then 3) and 6..7 (then 4): the latest wins
    assert propose(ctx, 3, 1, 3) == [4, 7, 8]
    # a longer match beats a later shorter one: [9, 1, 2] only at 5..7
    ctx2 = np.array([9, 1, 2, 6, 6, 6, 0, 1, 2, 5, 9, 1, 2])
    assert propose(ctx2, 2, 1, 3) == [6, 6]
    assert propose(ctx2, 2, 4, 4) == []  # no 4-gram recurs
    assert propose(np.array([1, 2, 3]), 2, 1, 2) == []  # the last token never occurred before
    assert propose(np.array([7, 7]), 5, 1, 2) == [7]  # the draft stops where the context ends
    # a prompt that repeats one token: only the latest MAX_CANDIDATES occurrences are extended
    from loramux.engine.spec_decode.ngram import MAX_CANDIDATES

    flat = np.concatenate([np.array([1, 2, 3]), np.full(4 * MAX_CANDIDATES, 7)])
    assert propose(flat, 4, 1, 8) == [7, 7, 7, 7]
    pairs = np.tile(np.array([1, 7]), 2 * MAX_CANDIDATES)
    mixed = np.concatenate([np.array([3, 5, 7, 8, 8]), pairs, np.array([3, 5, 7])])
    assert propose(mixed, 2, 3, 3) == []  # the only 3-gram match lies beyond the candidates searched
    assert propose(mixed, 2, 1, 3) == [3, 5]  # the latest single-token match
    assert propose(np.concatenate([mixed[:5], pairs[:8], mixed[-3:]]), 2, 3, 3) == [8, 8]
    buf = TokenBuffer()
    toks = list(range(300))
    assert buf.sync(toks).tolist() == toks
    toks += [1, 2]
    assert buf.sync(toks)[-3:].tolist() == [299, 1, 2]


def _seq(prompt, **params) -> Sequence:
    s = Sequence("r", 0, list(prompt), SamplingParams(**params))
    s.num_computed_tokens = s.num_tokens - 1
    return s


def test_drafter_caps_and_switches_itself_off_for_low_acceptance():
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1)
    d = Drafter(cfg, max_model_len=64)
    seq = _seq([1, 2, 3, 4, 5, 6, 1], temperature=0, max_tokens=3)
    assert d.draft(seq, 10, cost_ratio=0.01) == [2, 3]  # max_tokens 3: two drafts, then the sampled token
    assert d.draft(seq, 1, cost_ratio=0.01) == [2]  # the step's spare budget
    seq.grammar = object()
    assert d.draft(seq, 10, cost_ratio=0.01) == []  # guided rows never draft
    # the draft length follows the estimated acceptance a: draft i only while a ** i > ratio
    seq = _seq([1, 2, 3, 4, 5, 6, 1] * 2, temperature=0)
    assert len(d.draft(seq, 10, cost_ratio=0.5)) == 2  # a = 0.75 to start: 0.75, 0.56 > 0.5
    for _ in range(6):
        d.record(seq, 4, 4)
    assert seq.spec_state.acceptance > 0.9
    assert len(d.draft(seq, 10, cost_ratio=0.2)) == 4
    for _ in range(12):
        d.record(seq, 4, 0)
    assert seq.spec_state.acceptance < 0.2
    off = [d.draft(seq, 10, cost_ratio=0.2) for _ in range(10)]
    assert off[:9] == [[]] * 9 and len(off[9]) == 1  # 8 steps off, then one probing draft
    d.record(seq, 1, 0)
    off = [d.draft(seq, 10, cost_ratio=0.2) for _ in range(18)]
    assert off[:17] == [[]] * 17 and len(off[17]) == 1  # the back-off doubled
    c = d.snapshot()["base"]
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (19, 73, 24)
    assert c.accepted_per_pos == [6, 6, 6, 6]


def test_cost_ratio_follows_the_fitted_step_cost():
    from loramux.engine.step_budget import DEFAULT_COST_RATIO, cost_ratio

    assert cost_ratio(None, 3, 0) == pytest.approx(3 * DEFAULT_COST_RATIO)
    # c0 30 ms, 2 ms per decode row, 4 ms per extra token: 4 rows -> 4 * 4 / 38
    assert cost_ratio((0.030, 0.002, 0.004, 0.0), 4, 0) == pytest.approx(16 / 38)
    assert cost_ratio((0.030, 0.002, 0.5, 0.0), 64, 0) == 0.95  # never drafting is the floor
    # once verify rows were measured, a drafted token's own fitted cost counts
    assert cost_ratio((0.030, 0.002, 0.004, 0.0), 4, 0, c_draft=0.008) == pytest.approx(32 / 38)


def test_the_step_cost_model_fits_drafted_tokens_apart():
    from loramux.engine.step_budget import StepCostModel, StepShape

    m = StepCostModel()
    rng = np.random.default_rng(0)
    for _ in range(60):
        rows, prompt, drafts = int(rng.integers(1, 8)), int(rng.integers(0, 64)), int(rng.integers(0, 16))
        m.observe(StepShape(rows, prompt, 0, drafts), 0.01 + 0.002 * rows + 0.0005 * prompt + 0.003 * drafts)
    assert m.c_draft == pytest.approx(0.003, rel=1e-3)
    assert m.coef[2] == pytest.approx(0.0005, rel=1e-3) and len(m.coef) == 4
    assert m.predict(StepShape(2, 10, 0, 4)) == pytest.approx(0.01 + 0.004 + 0.005 + 0.012, rel=1e-3)


def test_scheduler_plans_verify_rows_and_frees_rejected_blocks():
    kv = KVCacheManager(64, 4)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=6, prompt_lookup_max=2), 128)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=64, enable_step_budget=False),
                           kv, 128, drafter=drafter)
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 7]
    seq = Sequence("r", 0, prompt, SamplingParams(temperature=0, max_tokens=30))
    sched.add(seq)
    outputs = make_output_processor(max_model_len=128)
    plan = sched.schedule()
    sample(outputs, sched, plan, model_output(sched, plan, lambda s, i: 8))  # prompt -> 8
    plan = sched.schedule()
    (row,) = plan.scheduled
    assert row.num_draft_tokens == 6 and row.token_ids == [8, 9, 10, 11, 12, 13, 14]
    assert not row.is_prefill and row.num_new_tokens == 7
    assert len(seq.block_table) == kv.blocks_for(seq.num_tokens + 6)
    # the model agrees with the first two drafts (9, 10), then says 99
    want = [9, 10, 99, 0, 0, 0, 0]
    logits = torch.full((7, VOCAB), -1e4)
    logits[torch.arange(7), torch.tensor(want)] = 0.0
    out = ModelOutput(plan.scheduled, logits[6:], draft_logits={0: logits[:6]})
    sample(outputs, sched, plan, out)
    assert seq.output_token_ids == [8, 9, 10, 99]
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert len(seq.block_table) == kv.blocks_for(seq.num_computed_tokens)  # the rest went back
    assert kv.num_free_blocks == 64 - len(seq.block_table)
    c = drafter.snapshot()["base"]
    assert (c.num_draft_tokens, c.num_accepted_tokens) == (6, 2)


def test_drafts_stay_within_the_token_budget_beside_prompts():
    kv = KVCacheManager(64, 4)
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=2), 128)
    sched = make_scheduler(SchedulerConfig(max_num_batched_tokens=10, enable_step_budget=False),
                           kv, 128, drafter=drafter)
    first = Sequence("a", 0, [7, 8, 9, 10, 11, 12, 13, 14, 7], SamplingParams(temperature=0, max_tokens=30))
    sched.add(first)
    plan = sched.schedule()
    sample(make_output_processor(max_model_len=128), sched, plan, model_output(sched, plan, lambda s, i: 8))
    sched.add(Sequence("b", 0, list(range(20, 40)), SamplingParams(temperature=0, max_tokens=4)))
    plan = sched.schedule()
    rows = {r.request_id: r for r in plan.scheduled}
    assert rows["a"].num_draft_tokens == 8  # drafts come first (decodes lead the step) ...
    assert rows["b"].num_new_tokens == 1  # ... and the prompt's chunk takes what is left
    assert plan.num_batched_tokens == 10


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)],
                         ids=["t1", "t0.7-top_p"])
def test_verified_sampling_is_exact_in_distribution(params):
    """Chi-square: the first token of a verify row follows the target distribution p0 whether
    its draft is accepted or not, the token after an accepted draft follows p1, and the same
    counts drawn without speculation agree with both."""
    torch.manual_seed(0)
    support = torch.tensor([3, 5, 8, 13, 21, 34])
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
    p1 = torch.tensor([0.05, 0.40, 0.15, 0.11, 0.09, 0.20])  # no ties at the top-p edge
    logits = torch.full((3, VOCAB), -1e9)
    logits[0, support] = p0.log()
    logits[1, support] = p1.log()
    logits[2, support] = 0.0
    target = []
    for p in (p0, p1):  # what the sampler's temperature / top-p make of them
        q = torch.softmax(p.log() / params["temperature"], 0)
        if "top_p" in params:
            order = q.argsort(descending=True)
            before = q[order].cumsum(0) - q[order]
            q[order[before >= params["top_p"]]] = 0
            q = q / q.sum()
        target.append(q.numpy().astype(np.float64))
    outputs = make_output_processor(max_model_len=64)
    draft = [5, 8]  # support[1], support[2]
    n = 6000
    first = np.zeros(6)
    second = np.zeros(6)
    seqs = [_seq([1, 2, 3], max_tokens=10, **params) for _ in range(n)]
    rows = [ScheduledRow("r", s.seq_id, 3, 2, [3, *draft], [], None, False, 0, 3, 2) for s in seqs]
    out = ModelOutput(rows, logits[2:].expand(n, -1), draft_logits={i: logits[:2] for i in range(n)})
    verify_drafts(outputs, out, list(range(n)), seqs, {})
    for s in seqs:
        toks = s.output_token_ids
        first[support.tolist().index(toks[0])] += 1
        if toks[0] == draft[0]:
            second[support.tolist().index(toks[1])] += 1
    keep = target[0] > 0
    assert _chi2_pvalue(first[keep], target[0][keep]) > 1e-3, first
    keep1 = target[1] > 0
    assert second[~keep1].sum() == 0
    assert _chi2_pvalue(second[keep1], target[1][keep1]) > 1e-3, second
    # without speculation: the plain sampler on the same logits, the same test
    plain = [_seq([1, 2, 3], max_tokens=10, **params) for _ in range(n)]
    picked = outputs.sampler(logits[:1].expand(n, -1), plain).token_ids
    base = np.bincount([support.tolist().index(t) for t in picked], minlength=6).astype(float)
    assert _chi2_pvalue(base[keep], target[0][keep]) > 1e-3, base
    # and the test has power: a sampler that always kept the draft would fail it
    biased = first.copy()
    biased[1] += 0.2 * n
    assert _chi2_pvalue(biased[keep], target[0][keep]) < 1e-6


@pytest.mark.parametrize("params", [
    dict(), dict(repetition_penalty=1.3), dict(logprobs=2), dict(min_tokens=6),
    dict(logit_bias={7: 2.0}), dict(max_tokens=3)], ids=["plain", "penalty", "logprobs",
                                                         "min_tokens", "bias", "max_tokens"])
def test_greedy_verification_picks_what_the_sampler_picks_position_by_position(params):
    """A verify step's rows, each checked against the sampler run position by position (the
    reference: :func:`_verify_sampled`); only rows that something processes call it."""
    from loramux.engine.spec_decode.verify import _verify_sampled, plain_greedy

    gen = torch.Generator().manual_seed(1)
    k, n = 5, 24
    draft_logits = {i: torch.randn(k, VOCAB, generator=gen) for i in range(n)}
    logits = torch.randn(n, VOCAB, generator=gen)
    seqs, refs, rows = [], [], []
    for i in range(n):
        # drafts that match the argmax for a random number of positions, then not
        agree = int(torch.randint(0, k + 1, (1,), generator=gen))
        drafts = [int(t) for t in draft_logits[i].argmax(-1)]
        drafts = drafts[:agree] + [(t + 1) % VOCAB for t in drafts[agree:]]
        kw = {"temperature": 0, "max_tokens": 20, **params}
        prompt = [7, 8, 9, 10 + i]
        seqs.append(_seq(prompt, **kw))
        refs.append(_seq(prompt, **kw))
        rows.append(ScheduledRow("r", i, 3, 1 + k, [10 + i, *drafts], [], None, False, 0, 3, k))
    outputs = make_output_processor(max_model_len=64)
    calls = []
    sampler = outputs.sampler

    class Counting:
        vocab_size = VOCAB

        def __call__(self, lg, ss):
            calls.append(len(ss))
            return sampler(lg, ss)

    outputs.sampler = Counting()
    out = ModelOutput(rows, logits, draft_logits=draft_logits)
    got = verify_drafts(outputs, out, list(range(n)), seqs, {})
    assert len(got) == n
    plain = plain_greedy(seqs[0])
    assert plain == (params == {} or params == {"max_tokens": 3})
    assert (not calls) if plain else calls, calls
    outputs.sampler = sampler
    from loramux.engine.spec_decode.verify import Verified

    want = [Verified(r, k) for r in refs]
    _verify_sampled(outputs, out, [(v, i, rows[i].token_ids[1:]) for i, v in enumerate(want)], {})
    for g, w, s, r in zip(got, want, seqs, refs, strict=True):
        assert s.output_token_ids == r.output_token_ids and g.num_accepted == w.num_accepted
        assert s.is_stopped == r.is_stopped and s.logprobs == r.logprobs
    assert {g.num_accepted for g in got} != {0}  # some drafts were accepted ...
    assert any(g.num_accepted < k for g in got)  # ... and some rejected


def test_non_finite_draft_logits_fail_only_their_row():
    from loramux.engine.output_processor import nonfinite_rows

    blocks = {i: torch.zeros(4, VOCAB) for i in range(4)}
    blocks[1][2, 5] = float("nan")
    blocks[2][0, 9] = float("-inf")
    blocks[3][:, :] = 3e38  # finite, but the cheap sum overflows: checked value by value
    rows = [ScheduledRow("r", i, 3, 5, [1, 2, 3, 4, 5], [], None, False, 0, 3, 4) for i in range(4)]
    out = ModelOutput(rows, torch.zeros(4, VOCAB), draft_logits=blocks)
    assert nonfinite_rows(out) == {1, 2}
