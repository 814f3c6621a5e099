"""The usage writer over a real ledger (SQLite): batches, a database outage spilled to disk
and replayed in order, a restart replaying what the last process left, replays counting
nothing twice, a full queue and refused records counted as dropped."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from loramux.platform.usage.policy import UsagePolicy
from loramux.platform.usage.recorder import UsageCounters, UsageRecorder
from loramux.registry.db import Database
from loramux.registry.models import Base, UsageRecord
from loramux.registry.usage import UsageLedger

POLICY = UsagePolicy(usage_batch_size=50, usage_flush_interval=0.05, usage_retry_interval=0.05)


class Counted(UsageCounters):
    def __init__(self) -> None:
        self.c: Counter = Counter()

    def written(self, n):
        self.c["written"] += n

    def spilled(self, n):
        self.c["spilled"] += n

    def dropped(self, reason, n):
        self.c[f"dropped:{reason}"] += n


class Flaky:
    """The ledger's append, failing like a database that is down while ``down``."""

    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger, self.down, self.calls, self.fail_after = ledger, False, 0, None

    def __call__(self, records):
        self.calls += 1
        if self.fail_after is not None:
            if self.fail_after == 0:
                raise OperationalError("INSERT", {}, ConnectionError("server closed the connection"))
            self.fail_after -= 1
        if self.down:
            raise OperationalError("INSERT", {}, ConnectionError("connection refused"))
        return self.ledger.append(records)


@pytest.fixture
def ledger(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'usage.db'}")
    Base.metadata.create_all(db.engine)
    yield UsageLedger(db)
    db.dispose()


def rec(i: int, **kw) -> dict:
    now = datetime.now(timezone.utc)
    return {"request_id": f"req-{i:06d}", "tenant_id": 1, "key_prefix": "0123456789ab",
            "adapter": "a", "version": 1, "endpoint": "chat", "prompt_tokens": 3,
            "cached_tokens": 0, "completion_tokens": 2, "finish_reason": "length", "error": None,
            "duration_ms": 1.0, "ttft_ms": 0.5, "tpot_ms": 0.1, "day": now.strftime("%Y-%m-%d"),
            "created_at": now, **kw}


def stored(ledger) -> list[str]:
    with ledger.db.session() as s:
        return list(s.scalars(select(UsageRecord.request_id).order_by(UsageRecord.id)))


def test_batches_and_flush(ledger, tmp_path):
    write = Flaky(ledger)
    r = UsageRecorder(write, tmp_path / "spill", POLICY).start()
    for i in range(120):
        assert r.record(rec(i))
    assert r.flush(10)
    assert stored(ledger) == [f"req-{i:06d}" for i in range(120)]
    assert write.calls <= 10  # in batches, not one call per record
    r.close()
    assert not list((tmp_path / "spill").glob("spill-*"))  # nothing ever spilled


def test_an_outage_spills_and_replays_in_order(ledger, tmp_path):
    write, counted = Flaky(ledger), Counted()
    r = UsageRecorder(write, tmp_path / "spill", POLICY, counters=counted).start()
    write.down = True
    for i in range(130):
        r.record(rec(i))
    assert r.flush(10)
    assert stored(ledger) == []
    [spill] = (tmp_path / "spill").glob("spill-*.jsonl")
    assert len(spill.read_text().splitlines()) == 130
    for i in range(130, 160):  # more traffic during the outage
        r.record(rec(i))
    assert r.flush(10)
    write.down = False
    for i in range(160, 170):  # the database is back: these wait behind the spill
        r.record(rec(i))
    assert r.flush(10)
    assert stored(ledger) == [f"req-{i:06d}" for i in range(170)]  # all, in order
    assert spill.stat().st_size == 0
    assert counted.c["spilled"] >= 160 and counted.c["written"] >= 170
    assert not any(k.startswith("dropped") for k in counted.c)
    r.close()


def test_a_restart_replays_what_the_last_process_left(ledger, tmp_path):
    write = Flaky(ledger)
    write.down = True
    first = UsageRecorder(write, tmp_path / "spill", POLICY).start()
    for i in range(40):
        first.record(rec(i))
    first.close()  # the database is still down: the file stays for the next start
    assert len(list((tmp_path / "spill").glob("spill-*.jsonl"))) == 1
    write.down = False
    second = UsageRecorder(write, tmp_path / "spill", POLICY).start()
    second.record(rec(40))
    assert second.flush(10)
    assert stored(ledger) == [f"req-{i:06d}" for i in range(41)]
    assert list((tmp_path / "spill").glob("spill-*.jsonl")) == []
    second.close()


def test_a_file_another_live_process_holds_is_left_alone(ledger, tmp_path):
    write = Flaky(ledger)
    write.down = True
    holder = UsageRecorder(write, tmp_path / "spill", POLICY).start()
    holder.record(rec(1))
    assert holder.flush(10)
    other = UsageRecorder(ledger.append, tmp_path / "spill", POLICY).start()
    other.record(rec(2))
    assert other.flush(10)
    assert stored(ledger) == ["req-000002"]  # the holder's record is its own business
    write.down = False
    assert holder.flush(10) and sorted(stored(ledger)) == ["req-000001", "req-000002"]
    holder.close()
    other.close()


def test_a_replay_cut_short_counts_nothing_twice(ledger, tmp_path):
    write = Flaky(ledger)
    write.down = True
    r = UsageRecorder(write, tmp_path / "spill", POLICY).start()
    for i in range(120):
        r.record(rec(i))
    assert r.flush(10)
    write.fail_after = 1  # the replay writes one batch, then the database fails again
    write.down = False
    assert r.flush(10)
    assert 0 < len(stored(ledger)) < 120
    write.fail_after = None
    assert r.flush(10)
    got = stored(ledger)
    assert got == [f"req-{i:06d}" for i in range(120)] and len(set(got)) == 120
    r.close()


def test_a_full_queue_and_refused_records_are_counted_as_dropped(ledger, tmp_path):
    counted = Counted()
    idle = UsageRecorder(ledger.append, tmp_path / "spill", UsagePolicy(usage_queue_size=3),
                         counters=counted)  # not started: nothing drains the queue
    assert [idle.record(rec(i)) for i in range(5)] == [True, True, True, False, False]
    assert counted.c["dropped:queue_full"] == 2

    def picky(records):
        if any(x["request_id"] == "req-000003" for x in records):
            raise ValueError("value out of range for column")  # not an outage
        return ledger.append(records)

    counted = Counted()
    r = UsageRecorder(picky, tmp_path / "spill2", POLICY, counters=counted).start()
    for i in range(6):
        r.record(rec(i))
    assert r.flush(10)
    assert stored(ledger) == [f"req-{i:06d}" for i in range(6) if i != 3]
    assert counted.c["dropped:refused"] == 1 and counted.c["spilled"] == 0
    r.close()


def test_a_damaged_spill_line_is_skipped(ledger, tmp_path):
    folder = tmp_path / "spill"
    folder.mkdir()
    good = [rec(i) for i in range(3)]
    lines = [json.dumps(good[0], default=str), "{not json", json.dumps(good[1], default=str),
             json.dumps(good[2], default=str)]
    (folder / "spill-left.jsonl").write_text("\n".join(lines) + "\n{\"cut\": ")
    r = UsageRecorder(ledger.append, folder, POLICY).start()
    assert r.flush(10)
    assert stored(ledger) == ["req-000000", "req-000001", "req-000002"]
    r.close()


def test_a_stalled_database_costs_a_batch_its_deadline_then_it_spills(ledger, tmp_path):
    import threading

    gate = threading.Event()
    stalled = {"on": True}

    def write(records):
        if stalled["on"]:
            gate.wait(30)  # a server that accepted the statement and never answers
        return ledger.append(records)

    counted = Counted()
    policy = UsagePolicy(usage_batch_size=50, usage_flush_interval=0.05,
                         usage_retry_interval=0.05, usage_write_timeout=0.2)
    r = UsageRecorder(write, tmp_path / "spill", policy, counters=counted).start()
    for i in range(10):
        r.record(rec(i))
    assert r.flush(5)  # did not wait for the stalled write
    assert counted.c["spilled"] >= 10
    stalled["on"] = False
    gate.set()  # the stuck write lands too; the replay's copies are skipped
    assert r.flush(5)
    assert stored(ledger) == [f"req-{i:06d}" for i in range(10)]
    r.close()
