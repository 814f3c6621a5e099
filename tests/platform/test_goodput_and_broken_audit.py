"""Goodput metrics (the share of requests that met both the TTFT and TPOT targets) and the
broken-adapter audit listener."""

from __future__ import annotations

from loramux.platform.metrics import Metrics


def test_goodput_share_counts_requests_that_met_both_targets():
    m = Metrics(goodput_ttft_s=1.0, goodput_tpot_s=0.1)
    assert m.goodput_share_value() is None
    m.observe_request("a", "completions", "ok", ttft=0.5, tpot=0.05, tenant="1")  # met both
    m.observe_request("a", "completions", "ok", ttft=1.5, tpot=0.05, tenant="1")  # TTFT missed
    m.observe_request("b", "completions", "ok", ttft=0.2, tpot=0.3, tenant="2")  # TPOT missed
    m.observe_request("b", "completions", "ok", ttft=0.2)  # one token: TTFT decides
    m.observe_request("b", "completions", "cancelled", ttft=0.2, tpot=0.01)  # not checked
    assert m.goodput_share_value() == 0.5
    text = m.render().decode()
    assert "loramux_goodput_share 0.5" in text
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}

    def value(name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))))

    assert value("loramux_goodput_requests_total", tenant="1", adapter="a", objective_met="true") == 1.0
    assert value("loramux_goodput_requests_total", tenant="1", adapter="a", objective_met="false") == 1.0
    assert value("loramux_goodput_requests_total", tenant="", adapter="b", objective_met="true") == 1.0
    assert value("loramux_goodput_misses_total", tenant="1", adapter="a", objective="ttft") == 1.0
    assert value("loramux_goodput_misses_total", tenant="2", adapter="b", objective="tpot") == 1.0


def test_a_broken_adapter_is_audited_off_the_engine_thread():
    import threading

    from loramux.platform.state import _broken_audit

    recorded = threading.Event()
    calls = []

    class Registry:
        def record_event(self, adapter_id, kind, *, actor=None, details=None):
            calls.append((adapter_id, kind, actor, threading.current_thread().name))
            recorded.set()

    class Resolver:
        def adapter_id_of(self, key):
            return 7 if key == "3/sql@abc" else None

    listener = _broken_audit(Registry(), Resolver())
    listener("evicted", "3/sql@abc")  # not audited here
    listener("broken", "static/x@def")  # no registry row: nothing to record
    listener("broken", "3/sql@abc")
    assert recorded.wait(5)
    assert calls == [(7, "broken", "engine", "broken-audit")]
