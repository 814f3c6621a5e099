"""Structural tags and grammars that wait for the end of a thought (``reasoning_end``):
the params, the gate fed by hand, the compiled tag over a real tokenizer's ids, and engine
runs on a tiny random model (plain, ``n`` = 2, ngram speculation with preemption)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from loramux.engine import LLM, SamplingParams
from loramux.engine.grammar_gate import GatedMatcher, constrains
from loramux.engine.structured_params import StructuredOutputsParams

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
ANSWER = {"enum": ["yes", "no", "maybe"]}  # no free whitespace: a random model's output ends


def tool_tag(schema: dict, **fmt) -> dict:
    """A structural tag: free text, and calls ``<tool_call>{...}</tool_call>`` of ``schema``."""
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], **fmt,
        "tags": [{"type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
                  "content": {"type": "json_schema", "json_schema": schema}}]}}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256)


# --- params ------------------------------------------------------------------------------
def test_structural_tag_params_as_the_platform_builds_them():
    tag = tool_tag(CITY)
    for spec in ({"structural_tag": tag}, {"structural_tag": json.dumps(tag)}):
        built = StructuredOutputsParams(**dict(spec))  # platform/openai/params.py's way
        assert SamplingParams(structured_outputs=dict(spec)).structured_outputs == built
    a = StructuredOutputsParams(structural_tag=tag)
    assert "structural_tag" in a.cache_key() and a.cache_key() != StructuredOutputsParams(json=CITY).cache_key()
    gated = dataclasses.replace(a, reasoning_end=[[7], [8, 9]])  # the platform's gate
    assert gated.reasoning_end == [[7], [8, 9]] and gated.cache_key() == a.cache_key()
    for bad, match in [
        ({"structural_tag": tag, "json": CITY}, "exactly one"),
        ({"structural_tag": "{not json"}, "structured_outputs.structural_tag is not valid JSON"),
        ({"structural_tag": [tag]}, "structured_outputs.structural_tag must be a JSON object"),
        ({"structural_tag": {"type": "json_schema", "format": {}}}, "structural_tag.type"),
        ({"structural_tag": {"type": "structural_tag"}}, "structural_tag needs a format"),
        ({"json": CITY, "reasoning_end": []}, "reasoning_end"),
        ({"json": CITY, "reasoning_end": [[1], []]}, "reasoning_end"),
        ({"json": CITY, "reasoning_end": [1, 2]}, "reasoning_end"),
        ({"json": CITY, "reasoning_end": [[-1]]}, "reasoning_end"),
        ({"reasoning_end": [[1]]}, "exactly one"),
    ]:
        with pytest.raises(ValueError, match=match):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match="reasoning_end contains token id 10"):
        SamplingParams(structured_outputs={"json": CITY, "reasoning_end": [[10]]}).verify_vocab(10)


# --- the gate, fed by hand ---------------------------------------------------------------
class FakeMatcher:
    def __init__(self) -> None:
        self.took: list[int] = []

    def accept_token(self, token: int) -> bool:
        self.took.append(token)
        return token != 0

    def is_terminated(self) -> bool:
        return bool(self.took) and self.took[-1] == 99

    def fill_next_token_bitmask(self, mask, index: int = 0) -> bool:
        mask[index] = 1
        return True


@pytest.mark.parametrize("feed, took", [
    ([1, 2, 5, 3, 4], [3, 4]),  # a one-token end
    ([1, 6, 6, 7, 3], [3]),  # a two-token end after a false start
    ([6, 1, 7, 5, 5], [5]),  # 6 .. 7 is not 6 7: the first 5 ends it
    ([1, 2, 3], []),  # no end yet: nothing reaches the matcher
    ([5, 6, 7, 8], [6, 7, 8]),  # after the end, an end is just a token
])
def test_gate_feeds_the_matcher_after_the_end(feed, took):
    gate = GatedMatcher(FakeMatcher(), [[5], [6, 7]])
    assert not constrains(gate) and not gate.is_terminated()
    with pytest.raises(RuntimeError):
        gate.fill_next_token_bitmask([0], 0)
    assert all(gate.accept_token(t) for t in feed)
    assert gate.matcher.took == took and constrains(gate) == (feed != [1, 2, 3])
    if constrains(gate):
        mask = [0]
        assert gate.fill_next_token_bitmask(mask, 0) and mask == [1]
        assert gate.accept_token(0) is False  # the matcher's refusal comes back
        gate.accept_token(99)
        assert gate.is_terminated()
    assert len(gate._tail) < 2  # O(longest end) state, whatever the output's length
    assert constrains(object()) and not constrains(None)


# --- a compiled structural tag over real token ids ---------------------------------------
def feed(matcher, tokenizer, text: str) -> int | None:
    """Index of the first token of ``text`` the matcher refuses (None: all accepted)."""
    for i, t in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        if not matcher.accept_token(t):
            return i
    return None


def test_structural_tag_takes_free_text_then_a_valid_call(llm):
    eng = llm.llm_engine
    tok, spec = eng.tokenizer, StructuredOutputsParams(structural_tag=json.dumps(tool_tag(CITY)))
    m = eng.structured.matcher(spec)
    assert feed(m, tok, 'Let me check the weather. <tool_call>{"city": "Paris"}</tool_call> Done.') is None
    m = eng.structured.matcher(spec)
    assert feed(m, tok, 'Sure. <tool_call>{"town": 1}</tool_call>') is not None
    m = eng.structured.matcher(spec)
    assert feed(m, tok, '<tool_call>{"city": 3}') is not None
    # the tag's grammar waits for the thought: its end ids close it, then a call must parse
    end = tok.encode(" END", add_special_tokens=False)
    gate = eng.structured.matcher(dataclasses.replace(spec, reasoning_end=[end]))
    assert isinstance(gate, GatedMatcher)
    assert feed(gate, tok, '<tool_call>{"town": 1} no grammar yet') is None and not gate.constraining
    assert all(gate.accept_token(t) for t in end) and gate.constraining
    assert feed(gate, tok, '<tool_call>{"town": 1}') is not None


def test_malformed_structural_tags_are_value_errors_naming_the_field(llm):
    for fmt in ({"type": "nope"}, {"type": "json_schema", "json_schema": {"type": "nonsense"}},
                {"type": "tag", "begin": "<a>", "end": "</a>"}):
        params = SamplingParams(structured_outputs={"structural_tag": {"type": "structural_tag", "format": fmt}})
        with pytest.raises(ValueError, match=r"^structured_outputs\.structural_tag is invalid: "):
            llm.generate(["x"], params)


def test_structural_tag_engine_run_parses(llm):
    tag = tool_tag(ANSWER, at_least_one=True, stop_after_first=True)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_outputs={"structural_tag": tag})
    for out in llm.generate(["Call a tool:", "Go"], params):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        assert comp.text.startswith("<tool_call>") and comp.text.endswith("</tool_call>")
        assert json.loads(comp.text[len("<tool_call>"): -len("</tool_call>")]) in ANSWER["enum"]


# --- the gate in engine runs -------------------------------------------------------------
def first_new(tokens: list[int], start: int) -> int:
    """The first position from ``start`` whose token did not come before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def check_gated(tokenizer, free: list[int], gated, end_at: int) -> None:
    """``gated`` (a completion) took ``free``'s tokens up to ``end_at`` (the thought's last
    token), unconstrained, and then an answer that parses against ANSWER."""
    ids = list(gated.token_ids)
    assert ids[: end_at + 1] == free[: end_at + 1]
    assert gated.finish_reason == "stop"
    answer = tokenizer.decode(ids[end_at + 1:], skip_special_tokens=True)
    assert json.loads(answer) in ANSWER["enum"], answer


def test_grammar_applies_after_the_thought(llm):
    tok = llm.llm_engine.tokenizer
    prompts = ["Think first:", "Plan:"]
    free = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    ends = [first_new(f, 3) for f in free]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={
        "json": ANSWER, "reasoning_end": [f[k - 1: k + 1], [tok.vocab_size - 1]]})  # a two-token end
        for f, k in zip(free, ends, strict=True)]
    for out, f, k in zip(llm.generate(prompts, params), free, ends, strict=True):
        check_gated(tok, list(f), out.outputs[0], k)
    # unconstrained until the end: the thought is the free run's; no end, no constraint
    never = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                           structured_outputs={"json": ANSWER, "reasoning_end": [[tok.vocab_size - 1]]})
    assert llm.generate(prompts[:1], never)[0].outputs[0].token_ids == free[0]


def test_each_of_n_siblings_has_its_own_gate(llm):
    tok = llm.llm_engine.tokenizer
    base = dict(temperature=1.0, seed=5, n=2, max_tokens=30)
    free = [list(c.token_ids) for c in llm.generate(["Think:"], SamplingParams(**base, ignore_eos=True))[0].outputs]
    k0, k1 = first_new(free[0], 2), first_new(free[1], 6)
    assert free[0][k0] not in free[1][: k1 + 1] and free[1][k1] not in free[0][: k0 + 1]
    params = SamplingParams(**base, structured_outputs={"json": ANSWER,
                                                        "reasoning_end": [[free[0][k0]], [free[1][k1]]]})
    outs = llm.generate(["Think:"], params)[0].outputs
    check_gated(tok, free[0], outs[0], k0)
    check_gated(tok, free[1], outs[1], k1)


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_ngram_speculation_and_preemption_keep_the_gated_outputs(tiny_model_dir):
    """Gated rows draft during the thought; their drafts are verified under the gate (masked
    from the token after its end): outputs equal the non-speculative ones, preempted or not."""
    prompts = ["def f(x):\n    return x + 1\n\ndef g(x):\n", "name: Ada, city: Paris. name: Bob,",
               "hello world", "SELECT name FROM users WHERE id = 1; SELECT"]

    def make(spec: bool, **kw) -> LLM:
        return LLM(str(tiny_model_dir), dtype="float32", max_model_len=256, block_size=4,
                   speculative_config=SPEC if spec else None, **kw)

    plain = make(False)
    tok = plain.llm_engine.tokenizer
    free = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    # the thought ends with its 20th token (the whole thought as the end: found nowhere
    # earlier), so the drafts of the model's loops are verified before and across the end
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs={
        "json": ANSWER, "reasoning_end": [list(f[:20])]}) for f in free]
    want = [o.outputs[0] for o in plain.generate(prompts, params)]
    for out, f in zip(want, free, strict=True):
        check_gated(tok, list(f), out, 19)
    for kw in ({}, {"num_gpu_blocks_override": 24}):
        llm = make(True, **kw)
        got = [o.outputs[0] for o in llm.generate(prompts, params)]
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        eng = llm.llm_engine
        stats = eng.stats().spec_decode
        assert sum(c.num_accepted_tokens for c in stats.values()) > 0, stats  # drafts in the thought
        if kw:
            assert eng.scheduler.num_preemptions > 0
