"""The per-adapter tool-call, parser-failure and reasoning-token series, read back with
prometheus-client's own parser."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loramux.platform.metrics import Metrics


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_parsing_counters():
    m = Metrics()
    m.observe_parsing("t1:calls@1", "hermes", tools_called=True, parse_failed=False,
                      reasoning_tokens=7)
    m.observe_parsing("t1:calls@1", "hermes", tools_called=False, parse_failed=True,
                      reasoning_tokens=0)
    m.observe_parsing("base", None, tools_called=False, parse_failed=True, reasoning_tokens=3)
    s = _samples(m)
    assert s[("loramux_tool_call_requests_total", (("adapter", "t1:calls@1"),))] == 1
    assert s[("loramux_tool_parser_failures_total",
              (("adapter", "t1:calls@1"), ("parser", "hermes")))] == 1
    assert s[("loramux_tool_parser_failures_total", (("adapter", "base"), ("parser", "json")))] == 1
    assert s[("loramux_reasoning_tokens_total", (("adapter", "t1:calls@1"),))] == 7
    assert s[("loramux_reasoning_tokens_total", (("adapter", "base"),))] == 3
