"""The engine on the real default model (SmolLM2-135M-Instruct, float32) against transformers."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest
import torch
from support.greedy_reference import check_greedy, teacher_forced_logits_batch

from loramux.engine import LLM, SamplingParams
from loramux.engine.async_engine import AsyncEngine

pytestmark = pytest.mark.e2e

NEW_TOKENS = 32
MAX_MODEL_LEN = 256

TEXT_PROMPTS = [
    "The capital of France is",
    "Hi",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot =",
    "Paged attention splits the key-value cache of every sequence into fixed-size blocks. "
    "Because blocks are allocated on demand, many more sequences fit in memory at once, and "
    "the scheduler can admit new requests while others are still decoding. When memory runs "
    "out, the newest sequence is preempted and recomputed later. In summary,",
    "1, 2, 3, 5, 8, 13,",
    "Le chat est sur",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers and explain why each is prime."},
    ],
]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, seed=0)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def hf(default_model_dir, llm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.to(llm.llm_engine.device).eval()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer(p).input_ids for p in TEXT_PROMPTS]
    for conv in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids.append(tokenizer(text, add_special_tokens=False).input_ids)
    assert len({len(p) for p in ids}) == 8
    return ids


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def greedy_run(llm, prompt_ids):
    """8 prompts as one continuous batch: 4 start, 4 more join after 3 steps."""
    engine = llm.llm_engine
    reqs = [engine.add_request(f"greedy-{i}", {"prompt_token_ids": p}, GREEDY) for i, p in enumerate(prompt_ids[:4])]
    for _ in range(3):
        engine.step()
    reqs += [
        engine.add_request(f"greedy-{i + 4}", {"prompt_token_ids": p}, GREEDY)
        for i, p in enumerate(prompt_ids[4:])
    ]
    assert all(r.seqs[0].num_output_tokens == 3 for r in reqs[:4])
    while engine.has_unfinished_requests():
        engine.step()
    return [r.to_output() for r in reqs]


@pytest.fixture(scope="module")
def hf_greedy(hf, tokenizer, prompt_ids):
    """transformers' own greedy generate, one left-padded batch."""
    width = max(len(p) for p in prompt_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None  # transformers may still stop at EOS: compared up to it
    config.pad_token_id = pad
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids.to(hf.device),
            attention_mask=mask.to(hf.device),
            generation_config=config,
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
        )
    eos = tokenizer.eos_token_id
    refs = []
    for row in out.cpu():
        ref = row[width:].tolist()
        refs.append(ref[: ref.index(eos) + 1] if eos in ref else ref)  # finished rows are padded
    return refs


@pytest.fixture(scope="module")
def greedy_logits(hf, greedy_run, prompt_ids):
    """transformers' logits over prompt + the engine's greedy output, per prompt."""
    return teacher_forced_logits_batch(hf, prompt_ids, [o.outputs[0].token_ids for o in greedy_run])


# ------------------------------------------------------------------------ (a) greedy, (b) logprobs


def test_greedy_equals_transformers(greedy_run, hf, hf_greedy, greedy_logits, prompt_ids):
    exact = 0
    for prompt, out, ref, logits in zip(prompt_ids, greedy_run, hf_greedy, greedy_logits, strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) == NEW_TOKENS and comp.finish_reason == "length"
        assert len(ref) > 8
        check_greedy(hf, prompt, comp.token_ids, reference_ids=ref, logits=logits)
        exact += comp.token_ids[: len(ref)] == ref
    assert exact >= 6, f"only {exact} of 8 completions equal transformers' generate exactly"


def test_logprobs_match_transformers(greedy_run, greedy_logits):
    for out, logits in zip(greedy_run, greedy_logits, strict=True):
        comp = out.outputs[0]
        ref = torch.log_softmax(logits.double(), dim=-1)
        assert len(comp.logprobs) == NEW_TOKENS
        total = 0.0
        for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            total += entry[tok].logprob
            assert entry[tok].rank == 1  # greedy
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[pos, tid].item(), abs=1e-4), (pos, tid)
            # the top-5 alternatives, by value (a near tie may swap two ids)
            alts = sorted((lp.logprob for lp in entry.values()), reverse=True)
            assert len(alts) == 5
            assert alts == pytest.approx(ref[pos].topk(5).values.tolist(), abs=1e-4)
        assert comp.cumulative_logprob == pytest.approx(total, abs=1e-6)


# ------------------------------------------------------------------------ (c) seeds


def test_seeded_request_same_alone_and_in_a_batch(llm):
    prompt = "Tell me a story about a dragon:"
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    batch = llm.generate(
        ["A long time ago", prompt, "The weather today", "Numbers: 1, 2,", prompt],
        [
            SamplingParams(temperature=1.0, max_tokens=12),
            seeded,
            SamplingParams(temperature=0, max_tokens=6),
            SamplingParams(temperature=0.7, seed=99, max_tokens=10),
            seeded.clone(seed=4321),
        ],
    )
    assert batch[1].outputs[0].token_ids == alone
    assert batch[4].outputs[0].token_ids != alone  # the seed matters


# ------------------------------------------------------------------------ (d) preemption


def test_preemption_keeps_greedy_outputs(default_model_dir, hf, greedy_run, greedy_logits, prompt_ids):
    n_new = 16
    # blocks the 8 sequences hold at the end (the last token needs no KV slot), minus 3
    needed = sum(-(-(len(p) + n_new - 1) // 16) for p in prompt_ids)
    num_blocks = needed - 3
    tight = LLM(
        str(default_model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        num_gpu_blocks_override=num_blocks,
        seed=0,
    )
    engine = tight.llm_engine
    outs = tight.generate([{"prompt_token_ids": p} for p in prompt_ids], GREEDY.clone(max_tokens=n_new))
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_free_blocks == num_blocks
    same = 0
    for prompt, out, free, logits in zip(prompt_ids, outs, greedy_run, greedy_logits, strict=True):
        got, want = out.outputs[0].token_ids, free.outputs[0].token_ids[:n_new]
        assert len(got) == n_new
        # equal, except after a near tie (different batch shapes round differently)
        check_greedy(hf, prompt, got, reference_ids=want, logits=logits[:n_new] if got == want else None)
        same += got == want
    assert same >= 6


# ------------------------------------------------------------------------ (e) stops, n, best_of, chat


def test_stop_string_stop_token_and_length(llm, tokenizer, greedy_run, prompt_ids):
    story = greedy_run[0].outputs[0]  # greedy continuation of TEXT_PROMPTS[0], ignore_eos
    text = story.text
    stop = text[9:14]  # in the middle, across token boundaries
    first = text.index(stop)
    token = story.token_ids[5]
    first_token = story.token_ids.index(token)
    prompt = {"prompt_token_ids": prompt_ids[0]}
    cut, kept, by_token, length = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "zzzz"]),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop,
                           include_stop_str_in_output=True),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[token]),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
    )
    comp = cut.outputs[0]
    assert comp.text == text[:first]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.token_ids == story.token_ids[: len(comp.token_ids)]
    assert len(comp.token_ids) < 24
    assert kept.outputs[0].text == text[: first + len(stop)]
    assert kept.outputs[0].token_ids == comp.token_ids

    comp = by_token.outputs[0]
    assert comp.token_ids == story.token_ids[: first_token + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == token
    assert comp.text == tokenizer.decode(story.token_ids[:first_token])

    comp = length.outputs[0]
    assert comp.token_ids == story.token_ids[:5]
    assert comp.finish_reason == "length" and comp.stop_reason is None


def test_eos_finishes_with_stop_and_chat_works(llm, tokenizer):
    messages = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    other = [{"role": "user", "content": "Say hi."}]
    out, out2 = llm.chat([messages, other], SamplingParams(temperature=0, max_tokens=48))
    comp = out.outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason is None
    assert comp.token_ids[-1] == tokenizer.eos_token_id
    assert "4" in comp.text and "<|im_end|>" not in comp.text
    assert comp.text == tokenizer.decode(comp.token_ids[:-1])
    for conv, o in ((messages, out), (other, out2)):
        expected_prompt = tokenizer.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert o.prompt_token_ids == list(expected_prompt)
    assert out2.outputs[0].text and out2.outputs[0].text != comp.text


def test_n_and_best_of(llm):
    prompt = "My favourite food is"
    # best_of=3, n=1 returns the candidate with the highest cumulative logprob: the same
    # three candidates (same per-sequence seeds) come back from n=3
    params = dict(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    n2, three, best, best_plain = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8),
            SamplingParams(n=3, logprobs=0, **params),
            SamplingParams(n=1, best_of=3, logprobs=0, **params),
            SamplingParams(n=1, best_of=3, **params),  # ranked even without logprobs
        ],
    )
    assert [c.index for c in n2.outputs] == [0, 1]
    assert n2.outputs[0].token_ids != n2.outputs[1].token_ids
    assert len(three.outputs) == 3 and len(best.outputs) == 1 and len(best_plain.outputs) == 1
    top = max(three.outputs, key=lambda c: c.cumulative_logprob)
    assert min(c.cumulative_logprob for c in three.outputs) < top.cumulative_logprob
    assert best.outputs[0].token_ids == top.token_ids
    assert best.outputs[0].cumulative_logprob == pytest.approx(top.cumulative_logprob, abs=1e-5)
    assert best_plain.outputs[0].token_ids == top.token_ids


# ------------------------------------------------------------------------ (f) AsyncEngine


@pytest.fixture
def async_engine(llm):
    engine = AsyncEngine(llm.llm_engine)
    yield engine
    engine.shutdown()
    assert not engine._thread.is_alive()


async def test_async_concurrent_generate(async_engine, hf, tokenizer):
    prompts = ["The capital of France is", "Hi", "1, 2, 3, 5, 8, 13,", "Le chat est sur"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def run(i, prompt):
        snapshots = []
        async for out in async_engine.generate(prompt, params, request_id=f"async-{i}"):
            snapshots.append(out)
        return snapshots

    results = await asyncio.wait_for(asyncio.gather(*(run(i, p) for i, p in enumerate(prompts))), 300)
    for prompt, snaps in zip(prompts, results, strict=True):
        final = snaps[-1]
        assert final.finished and sum(s.finished for s in snaps) == 1
        ids = final.outputs[0].token_ids
        assert len(ids) == 12
        for a, b in zip(snaps, snaps[1:], strict=False):  # cumulative snapshots
            assert b.outputs[0].token_ids[: len(a.outputs[0].token_ids)] == a.outputs[0].token_ids
        check_greedy(hf, tokenizer(prompt).input_ids, ids)
    assert len(results[0]) > 1  # streamed, not one final result


async def test_async_break_aborts_and_frees_blocks(async_engine, llm):
    engine = llm.llm_engine
    total = engine.kv.pool.num_blocks
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    seen = 0
    req = None
    async for out in async_engine.generate("Once upon a time", params, request_id="to-abort"):
        seen += 1
        if req is None:
            req = await async_engine.call(lambda: engine.requests.get("to-abort"))
        assert not out.finished
        if seen == 3:
            break
    assert req is not None
    deadline = time.monotonic() + 30
    while True:
        free, live = await async_engine.call(lambda: (engine.kv.num_free_blocks, "to-abort" in engine.requests))
        if free == total and not live:
            break
        assert time.monotonic() < deadline, f"blocks not freed: {free}/{total}, request live: {live}"
        await asyncio.sleep(0.05)
    seq = req.seqs[0]
    assert seq.finish_reason == "abort" and req.aborted
    assert seq.num_output_tokens < 200
    assert async_engine.stats().num_running == 0
