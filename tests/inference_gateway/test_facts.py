"""From a load report to the facts a scraper may read (pure): names only, each once, at
its best level; disk-only and broken adapters are not loaded; the facts survive JSON."""

from __future__ import annotations

from loramux.engine.lora.state import ResidencySnapshot
from loramux.engine.outputs import EngineStats, LoadReport
from loramux.platform.inference_gateway.exposition import ProtocolFacts, render
from loramux.platform.inference_gateway.facts import FactsBuilder


def row(key: str, tier: str, pinned: bool = False, error: str | None = None) -> dict:
    return {"name": key, "tier": tier, "pinned": pinned, "error": error}


def report(rows, running=None, waiting=None, kv=0.25) -> LoadReport:
    return LoadReport(EngineStats(3, 2, kv, 0), running or {}, waiting or {},
                      ResidencySnapshot(rows, max_loras=4, lora_enabled=True),
                      num_kv_blocks=100, block_size=16, taken_at=1.7e9)


def test_names_once_best_level_and_counts():
    rows = [row("1/shared@aaa", "cpu"), row("2/shared@bbb", "device", pinned=True),
            row("1/only@ccc", "cpu"), row("1/cold@ddd", "disk"),
            row("2/broken@eee", "device", error="non-finite"), row("static/fixed@fff", "gpu")]
    facts = FactsBuilder("base", True, 0.9, True)(report(
        rows, running={"1/shared@aaa": 2, "2/shared@bbb": 1}, waiting={"1/only@ccc": 1}))
    levels = {(a.name, a.level, a.pinned) for a in facts.resident}
    assert levels == {("shared", "gpu", True), ("only", "cpu", False), ("fixed", "gpu", False)}
    assert (facts.num_gpu_loaded, facts.num_cpu_loaded) == (2, 2)  # adapters, not names
    assert facts.running_adapters == ("shared",) and facts.waiting_adapters == ("only",)
    assert (facts.max_lora, facts.num_running, facts.num_waiting) == (4, 3, 2)
    text = render(facts).decode()
    for secret in ("aaa", "bbb", "1/", "2/", "static/", "broken", "cold"):
        assert secret not in text
    assert ProtocolFacts.from_json(facts.to_json()) == facts


def test_kv_fraction_is_clamped_and_lora_off_has_no_lora_series():
    facts = FactsBuilder("base", False, 0.5, False)(report([], kv=1.2))
    assert facts.kv_cache_usage == 1.0
    text = render(facts).decode()
    assert "vllm:num_requests_running" in text and "vllm:lora" not in text


def test_spec_decode_counters_sum_over_adapters_and_are_absent_when_off():
    from prometheus_client.parser import text_string_to_metric_families

    from loramux.engine.spec_decode.drafter import SpecCounts

    stats = EngineStats(1, 0, 0.1, 0, spec_decode={
        "1/sql@aaa": SpecCounts(5, 17, 9, [4, 3, 2]), "base": SpecCounts(2, 8, 1, [1])})
    rep = LoadReport(stats, {}, {}, ResidencySnapshot([], max_loras=4, lora_enabled=True),
                     num_kv_blocks=100, block_size=16, taken_at=1.7e9)
    facts = FactsBuilder("base", True, 0.9, True, num_speculative_tokens=4)(rep)
    assert ProtocolFacts.from_json(facts.to_json()) == facts
    text = render(facts).decode()
    assert "aaa" not in text and "sql" not in text  # one engine's totals, no adapter names
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    want = {"vllm:spec_decode_num_drafts": 7, "vllm:spec_decode_num_draft_tokens": 25,
            "vllm:spec_decode_num_accepted_tokens": 10}
    for name, value in want.items():
        assert fams[name].type == "counter"
        (s,) = fams[name].samples
        assert (s.name, s.labels, s.value) == (name + "_total", {"model_name": "base", "engine": "0"}, value)
    per_pos = fams["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos.type == "counter"
    assert {s.labels["position"]: s.value for s in per_pos.samples} == {"0": 5, "1": 3, "2": 2, "3": 0}
    assert all(s.labels["model_name"] == "base" and s.labels["engine"] == "0" for s in per_pos.samples)
    off = render(FactsBuilder("base", True, 0.9, True)(rep)).decode()
    assert "spec_decode" not in off
