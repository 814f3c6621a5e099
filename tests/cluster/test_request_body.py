"""What a gateway charges a request before it runs (no tokenizer), and reads back after."""

from __future__ import annotations

import json

from loramux.platform.cluster.request_body import (
    DEFAULT_MAX_TOKENS,
    prompt_text,
    request_cost,
    usage_tokens,
)


def test_cost_counts_every_sequence_and_the_prompt_bytes():
    body = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 10, "n": 2,
            "best_of": 3}
    cost = request_cost(body)
    assert cost.sequences == 3 and cost.tokens == 40 // 4 + 1 + 10 * 3
    assert prompt_text({"prompt": "abc"}) == "abc"


def test_cost_ignores_values_of_the_wrong_type():
    cost = request_cost({"prompt": "", "max_tokens": "9", "n": True, "best_of": -4})
    assert cost.sequences == 1 and cost.tokens == 1 + DEFAULT_MAX_TOKENS
    assert request_cost({"prompt": "", "max_completion_tokens": 5}).tokens == 6


def test_usage_is_read_from_json_answers_only():
    assert usage_tokens(json.dumps({"usage": {"total_tokens": 17}}).encode()) == 17
    assert usage_tokens(b"not json") is None
    assert usage_tokens(b'{"usage": null}') is None
    assert usage_tokens(b'{"usage": {"total_tokens": "7"}}') is None


def test_a_responses_body_is_read_like_a_chat_one():
    body = {"model": "m", "instructions": "be brief", "max_output_tokens": 40,
            "input": [{"role": "user", "content": "hi"},
                      {"type": "function_call_output", "call_id": "c", "output": "sunny"}]}
    assert prompt_text(body) == "be brief\nhi\nsunny"
    assert prompt_text({"model": "m", "input": "hello"}) == "hello"
    assert request_cost(body) == request_cost({"prompt": "be brief\nhi\nsunny", "max_tokens": 40})
