"""The dashboard's rolling window (``admin/activity.py``) with a fake clock."""

from __future__ import annotations

from types import SimpleNamespace

from loramux.platform.admin.activity import BUCKET_S, WINDOW_S, Activity


def test_window_series_in_flight_and_rejections():
    now = [1000.0]
    act = Activity(clock=lambda: now[0])
    alice = SimpleNamespace(tenant_id=7)
    act.begin("r1", "7/a@x", alice)
    act.begin("r2", "base", alice)
    assert act.adapter("7/a@x")["in_flight"] == 1 and act.tenant(7)["in_flight"] == 2
    now[0] += 1
    act.end("r1", 10)
    act.end("r1", 10)  # idempotent
    act.end("r2", 4)
    a, t = act.adapter("7/a@x"), act.tenant(7)
    assert (a["in_flight"], a["requests_1m"], a["tokens_1m"]) == (0, 1, 10)
    assert (t["in_flight"], t["requests_1m"], t["tokens_1m"]) == (0, 2, 14)
    assert len(a["tokens_per_s"]) == WINDOW_S // BUCKET_S and a["tokens_per_s"][-1] == 10 / BUCKET_S
    assert act.tokens_per_s(10) == 1.4  # adapters only: the tenant series is not counted twice
    assert act.tenant(8)["requests_1m"] == 0

    act.rejected(7, "queue_full", "full")
    assert [r.code for r in act.rejections(7)] == ["queue_full"] and act.rejections(8) == []
    now[0] += WINDOW_S + BUCKET_S
    a = act.adapter("7/a@x")
    assert (a["requests_1m"], a["tokens_1m"], sum(a["tokens_per_s"])) == (0, 0, 0)
    assert a["last_used"] == 1001.0
