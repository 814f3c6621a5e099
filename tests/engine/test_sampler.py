"""The vectorized sampler against hand-computed distributions on small vocabularies."""

from __future__ import annotations

import math

import pytest
import torch

from loramux.engine.sampler import Sampler
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence

V = 6
EOS = 5


def make_sampler(vocab: int = V, eos: int = EOS, seed: int = 0) -> Sampler:
    return Sampler(vocab, {eos}, torch.Generator().manual_seed(seed))


def make_seq(prompt=(0,), output=(), seed: int | None = None, **params) -> Sequence:
    seq = Sequence("r", 0, list(prompt), SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def processed(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The logits each row is sampled from (after masks, bias and penalties)."""
    return sampler._process(logits, seqs)


def rows(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def frequencies(tokens: list[int], vocab: int = V) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    return (counts / counts.sum()).tolist()


def assert_distribution(tokens: list[int], expected: list[float]) -> None:
    """Empirical frequencies within 5 sigma of ``expected``; zero-mass tokens never drawn."""
    n = len(tokens)
    got = frequencies(tokens, len(expected))
    assert sum(expected) == pytest.approx(1.0, abs=1e-9)
    for tok, (f, p) in enumerate(zip(got, expected, strict=True)):
        if p == 0.0:
            assert f == 0.0, f"token {tok} has zero probability but was drawn ({f:.4f})"
        else:
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(f - p) < 5 * sigma + 1e-12, f"token {tok}: freq {f:.4f} vs p {p:.4f}\n{got}"


def draw(sampler: Sampler, logits_row: list[float], n: int, **params) -> list[int]:
    """``n`` independent draws from one row's distribution (one batch of n identical rows)."""
    seq = make_seq(**params)
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(n, -1).contiguous()
    return sampler(logits, [seq] * n).token_ids


def renorm(probs: list[float]) -> list[float]:
    s = sum(probs)
    return [p / s for p in probs]


# distribution used by the sampling tests: probabilities p, logits log p
P = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGP = [math.log(p) for p in P]
N_DRAWS = 20_000


# ------------------------------------------------------------------------ logits processing


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    s = make_sampler()
    logits = rows([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    seq = make_seq(prompt=[0, 1], output=[2, 2], repetition_penalty=2.0)
    out = processed(s, logits, [seq])
    # tokens 0 (prompt, positive), 1 (prompt, negative), 2 (output, positive, once per token)
    assert out[0].tolist() == pytest.approx([1.0, -2.0, 0.25, 3.0, -2.0, 1.0])
    # input untouched
    assert logits[0, 0].item() == 2.0


def test_repetition_penalty_below_one_boosts_seen_tokens():
    s = make_sampler()
    logits = rows([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    seq = make_seq(prompt=[0, 1], output=[], repetition_penalty=0.5)
    assert processed(s, logits, [seq])[0].tolist() == pytest.approx([4.0, -0.5, 0.5, 3.0, -2.0, 1.0])
    # and it decides a greedy pick: token 0 (2.0 -> 4.0) beats token 3 (3.0)
    assert s(logits, [make_seq(prompt=[0, 1], temperature=0, repetition_penalty=0.5)]).token_ids == [0]
    assert s(logits, [make_seq(prompt=[0, 1], temperature=0)]).token_ids == [3]


def test_presence_and_frequency_penalties_are_additive_over_generated_tokens_only():
    s = make_sampler()
    logits = rows([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # token 4 is only in the prompt: never penalized by presence/frequency
    seq = make_seq(prompt=[4, 4, 4], output=[1, 2, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = processed(s, logits, [seq])[0].tolist()
    assert out == pytest.approx([1.0, 1.0 - 0.5 - 0.25, 1.0 - 0.5 - 0.75, 1.0, 1.0, 1.0])


def test_negative_presence_penalty_encourages_repetition():
    s = make_sampler()
    logits = rows([1.0, 1.2, 0.0, 0.0, 0.0, 0.0])
    seq = make_seq(prompt=[1], output=[0], presence_penalty=-0.5, temperature=0)
    assert processed(s, logits, [seq])[0].tolist() == pytest.approx([1.5, 1.2, 0, 0, 0, 0])
    assert s(logits, [seq]).token_ids == [0]


def test_penalties_are_per_row():
    s = make_sampler()
    base = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    logits = rows(base, base, base)
    seqs = [
        make_seq(prompt=[0], output=[3], repetition_penalty=2.0),
        make_seq(prompt=[0], output=[3]),
        make_seq(prompt=[0], output=[3], frequency_penalty=1.0),
    ]
    out = processed(s, logits, seqs)
    assert out[0].tolist() == pytest.approx([1.0, -1.0, 0.5, 1.5, -2.0, 1.0])
    assert out[1].tolist() == pytest.approx(base)
    assert out[2].tolist() == pytest.approx([2.0, -1.0, 0.5, 2.0, -2.0, 1.0])


def test_logit_bias_is_added_and_can_flip_greedy():
    s = make_sampler()
    logits = rows([1.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    seq = make_seq(logit_bias={3: 0.75, 0: -100}, temperature=0)
    assert processed(s, logits, [seq])[0].tolist() == pytest.approx([-99.0, 0, 0, 1.25, 0, 0])
    assert s(logits, [seq]).token_ids == [3]
    # exclusion with -100 also holds when sampling
    tokens = draw(s, [5.0, 0, 0, 0, 0, 0], 2000, logit_bias={0: -100})
    assert 0 not in tokens


def test_min_tokens_blocks_eos_and_stop_token_ids():
    s = make_sampler()
    logits = rows([0.0, 0.0, 2.0, 0.0, 0.0, 3.0])  # EOS (5) best, then stop token 2
    params = dict(min_tokens=2, stop_token_ids=[2], temperature=0)
    assert s(logits, [make_seq(output=[], **params)]).token_ids == [0]
    assert s(logits, [make_seq(output=[1], **params)]).token_ids == [0]
    assert s(logits, [make_seq(output=[1, 1], **params)]).token_ids == [5]
    out = processed(s, logits, [make_seq(output=[1], **params)])[0]
    assert out[5].item() == float("-inf") and out[2].item() == float("-inf")
    assert out[0].item() == 0.0
    # sampled rows never draw a blocked token either
    tokens = draw(s, [0.0, 0.0, 2.0, 0.0, 0.0, 3.0], 2000, min_tokens=1, stop_token_ids=[2])
    assert not {2, 5} & set(tokens)
    # without min_tokens nothing is blocked
    assert s(logits, [make_seq(output=[], stop_token_ids=[2], temperature=0)]).token_ids == [5]


def test_allowed_token_ids():
    s = make_sampler()
    logits = rows([3.0, 2.0, 1.0, 0.5, 0.0, 0.0])
    assert s(logits, [make_seq(allowed_token_ids=[2, 3], temperature=0)]).token_ids == [2]
    out = processed(s, logits, [make_seq(allowed_token_ids=[2, 3])])[0]
    assert out.tolist() == [float("-inf"), float("-inf"), 1.0, 0.5, float("-inf"), float("-inf")]
    tokens = draw(s, LOGP, N_DRAWS, allowed_token_ids=[1, 4])
    assert_distribution(tokens, [0, 0.25 / 0.31, 0, 0, 0.06 / 0.31, 0])


# ------------------------------------------------------------------------ picking


def test_greedy_is_argmax_per_row_in_a_mixed_batch():
    s = make_sampler()
    torch.manual_seed(0)
    logits = torch.randn(8, V)
    seqs = [make_seq(temperature=0) if i % 2 == 0 else make_seq(temperature=1.0) for i in range(8)]
    picked = s(logits, seqs).token_ids
    for i in range(0, 8, 2):
        assert picked[i] == int(logits[i].argmax())


def test_greedy_ignores_top_k_top_p_min_p():
    s = make_sampler()
    logits = rows([0.1, 0.2, 3.0, 0.0, 0.0, 0.0])
    seq = make_seq(temperature=0, top_k=1, top_p=0.1, min_p=0.9)
    assert s(logits, [seq]).token_ids == [2]


def test_temperature_one_samples_softmax():
    assert_distribution(draw(make_sampler(seed=1), LOGP, N_DRAWS), P)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    tempered = renorm([p ** (1 / temperature) for p in P])
    assert_distribution(draw(make_sampler(seed=2), LOGP, N_DRAWS, temperature=temperature), tempered)


def test_top_k():
    assert_distribution(draw(make_sampler(seed=3), LOGP, N_DRAWS, top_k=2), [0.4 / 0.65, 0.25 / 0.65, 0, 0, 0, 0])
    assert set(draw(make_sampler(seed=3), LOGP, 500, top_k=1)) == {0}
    # -1 and 0 mean "off"
    assert_distribution(draw(make_sampler(seed=3), LOGP, N_DRAWS, top_k=-1), P)


def test_top_p_nucleus():
    # cumulative mass before each token: 0, .40, .65, .80, .90, .96 -> with top_p .7 keep 3
    expected = renorm(P[:3] + [0, 0, 0])
    assert_distribution(draw(make_sampler(seed=4), LOGP, N_DRAWS, top_p=0.7), expected)


@pytest.mark.parametrize("top_p", [0.3, 0.01])
def test_top_p_always_keeps_the_top_token(top_p):
    assert set(draw(make_sampler(seed=5), LOGP, 1000, top_p=top_p)) == {0}


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    # after top_k=3: [.5, .3125, .1875]; mass before: 0, .5, .8125 -> top_p .7 keeps 2
    # (on the raw distribution, mass before token 2 is .65 < .7 and it would be kept)
    expected = renorm(P[:2] + [0, 0, 0, 0])
    assert_distribution(draw(make_sampler(seed=6), LOGP, N_DRAWS, top_k=3, top_p=0.7), expected)


def test_min_p():
    # threshold .3 * .4 = .12: keeps .4, .25, .15
    assert_distribution(draw(make_sampler(seed=7), LOGP, N_DRAWS, min_p=0.3), renorm(P[:3] + [0, 0, 0]))
    # min_p 1.0 keeps only the top token
    assert set(draw(make_sampler(seed=7), LOGP, 500, min_p=1.0)) == {0}


def test_min_p_applies_after_temperature():
    # T = 2: probabilities proportional to sqrt(p) = .632 .5 .387 .316 .245 .2;
    # min_p .55 keeps those >= .348 (the first three); at T = 1 it would keep only two.
    tempered = [math.sqrt(p) for p in P]
    expected = renorm(tempered[:3] + [0, 0, 0])
    assert_distribution(draw(make_sampler(seed=8), LOGP, N_DRAWS, temperature=2.0, min_p=0.55), expected)


def test_rows_with_different_parameters_in_one_batch():
    s = make_sampler(seed=9)
    n = 6000
    groups = [dict(top_k=1), dict(temperature=1.0), dict(allowed_token_ids=[3, 4]), dict(temperature=0)]
    seqs = [make_seq(**groups[i % 4]) for i in range(4 * n)]
    logits = torch.tensor([LOGP], dtype=torch.float32).expand(4 * n, -1).contiguous()
    picked = s(logits, seqs).token_ids
    assert set(picked[0::4]) == {0}
    assert_distribution(picked[1::4], P)
    assert_distribution(picked[2::4], [0, 0, 0, 0.1 / 0.16, 0.06 / 0.16, 0])
    assert set(picked[3::4]) == {0}


# ------------------------------------------------------------------------ seeds


def _run_steps(seq: Sequence, others: list[Sequence], steps: list[torch.Tensor], sampler: Sampler):
    """Sample ``len(steps)`` tokens for ``seq`` with ``others`` around it; returns its tokens."""
    for t, logits in enumerate(steps):
        batch = others[: t % (len(others) + 1)] + [seq] + others[t % (len(others) + 1) :]
        big = torch.randn(len(batch), logits.shape[0])
        big[batch.index(seq)] = logits
        picked = sampler(big, batch).token_ids
        seq.append_token(picked[batch.index(seq)])
        for o in others:
            o.append_token(picked[batch.index(o)])
    return seq.output_token_ids


def test_seeded_row_is_reproducible_whatever_else_is_in_the_batch():
    torch.manual_seed(1)
    vocab = 50
    steps = [torch.randn(vocab) for _ in range(12)]
    params = dict(temperature=1.0, top_p=0.95)
    alone = _run_steps(make_seq(seed=1234, **params), [], steps, make_sampler(vocab, eos=49, seed=0))
    others = [
        make_seq(seed=99, temperature=0.7),
        make_seq(temperature=1.3),
        make_seq(temperature=0),
        make_seq(seed=1234, temperature=1.0),  # same seed, own generator
    ]
    batched = _run_steps(make_seq(seed=1234, **params), others, steps, make_sampler(vocab, eos=49, seed=7))
    assert alone == batched
    other_seed = _run_steps(make_seq(seed=4321, **params), [], steps, make_sampler(vocab, eos=49, seed=0))
    assert other_seed != alone


def test_unseeded_rows_follow_the_engine_generator():
    a = draw(make_sampler(seed=11), LOGP, 64)
    b = draw(make_sampler(seed=11), LOGP, 64)
    c = draw(make_sampler(seed=12), LOGP, 64)
    assert a == b
    assert a != c


# ------------------------------------------------------------------------ logprobs


def test_logprobs_are_raw_log_softmax_with_rank_and_top_n():
    s = make_sampler()
    logits = rows([1.0, 3.0, 2.0, -1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 4.0, 0.0, 1.0])
    seqs = [
        # processing changes the pick to token 0 but logprobs stay those of the raw logits
        make_seq(temperature=0, logprobs=3, logit_bias={0: 10.0}, output=[1], repetition_penalty=1.5),
        make_seq(temperature=0, logprobs=0),
    ]
    out = s(logits, seqs)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_ids == [0, 3]
    assert out.logprobs[0] == pytest.approx(raw[0, 0].item(), abs=1e-6)
    assert out.logprobs[1] == pytest.approx(raw[1, 3].item(), abs=1e-6)
    assert out.ranks == [3, 1]
    assert out.top_ids[0] == [1, 2, 0]
    assert out.top_logprobs[0] == pytest.approx(raw[0, [1, 2, 0]].tolist(), abs=1e-6)
    assert out.top_ids[1] == [] and out.top_logprobs[1] == []


def test_no_logprobs_when_nobody_asks():
    out = make_sampler()(rows([0.0, 1.0, 0, 0, 0, 0]), [make_seq(temperature=0)])
    assert out.token_ids == [1]
    assert out.logprobs is None and out.ranks is None


def test_logprobs_ignore_temperature():
    s = make_sampler()
    logits = rows(LOGP)
    out = s(logits, [make_seq(temperature=0.3, logprobs=6, seed=0)])
    assert out.top_logprobs[0] == pytest.approx(LOGP, abs=1e-5)
    assert out.logprobs[0] == pytest.approx(LOGP[out.token_ids[0]], abs=1e-5)


def test_best_of_rows_get_a_logprob_for_ranking():
    # best_of > n ranks completions by cumulative logprob: the sampler must report it
    # even when the request did not ask for logprobs.
    s = make_sampler()
    seq = make_seq(n=1, best_of=2, temperature=1.0, seed=0)
    out = s(rows(LOGP), [seq])
    assert out.logprobs is not None
    assert out.logprobs[0] == pytest.approx(LOGP[out.token_ids[0]], abs=1e-5)


def test_vocab_padding_is_ignored():
    # logits wider than the vocabulary (padded lm_head): the extra columns are never picked
    s = make_sampler(vocab=4, eos=3)
    logits = rows([0.0, 1.0, 0.0, 0.0, 50.0, 60.0])
    assert s(logits, [make_seq(temperature=0, logprobs=1)]).token_ids == [1]
    tokens = draw(s, [0.0, 1.0, 0.0, 0.0, 50.0, 60.0], 500)
    assert max(tokens) < 4
