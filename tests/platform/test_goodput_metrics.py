"""Goodput: the share of finished requests that met both the TTFT and the TPOT target."""

from __future__ import annotations

from loramux.platform.metrics import Metrics


def test_goodput_share_counts_requests_that_met_both_targets():
    m = Metrics(goodput_ttft_s=1.0, goodput_tpot_s=0.1)
    assert m.goodput_share_value() is None
    m.observe_request("a", "completions", "ok", ttft=0.5, tpot=0.05)  # met both
    m.observe_request("a", "completions", "ok", ttft=1.5, tpot=0.05)  # TTFT missed
    m.observe_request("b", "completions", "ok", ttft=0.2, tpot=0.3)  # TPOT missed
    m.observe_request("b", "completions", "ok", ttft=0.2)  # one token: TTFT decides
    m.observe_request("b", "completions", "cancelled", ttft=0.2, tpot=0.01)  # not checked
    assert m.goodput_share_value() == 0.5
    text = m.render().decode()
    assert "loramux_goodput_share 0.5" in text
    assert 'loramux_goodput_requests_total{adapter="a"} 1.0' in text
    assert 'loramux_goodput_eligible_requests_total{adapter="b"} 2.0' in text
