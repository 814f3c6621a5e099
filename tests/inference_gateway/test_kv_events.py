"""KV-cache events over ZeroMQ: a subscriber rebuilds the block index from the messages
(vLLM's three frames, msgpack batches of tagged maps) and it equals the engine's prefix
cache after a run with prefix hits and evictions; a full queue drops and counts, never
blocks the caller."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import msgpack
import pytest
import zmq
from support.gateway import Tenants
from support.platform_settings import ADMIN_KEY, settings
from support.server import free_port, make_engine, serve_in_thread

from loramux.engine.sampling_params import SamplingParams
from loramux.platform.app import create_app
from loramux.platform.inference_gateway.kv_events import KVEventPublisher, external_hash
from loramux.platform.state import close_state


class Subscriber:
    """A SUB socket in a thread that keeps every message (topic, seq, decoded payload)."""

    def __init__(self, endpoint: str) -> None:
        self.messages: list[tuple[bytes, int, list]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self._sock.bind(endpoint)  # the engine connects (tcp://host:port), as to an indexer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if poller.poll(50):
                topic, seq, payload = self._sock.recv_multipart()
                assert len(seq) == 8
                self.messages.append((topic, int.from_bytes(seq, "big"),
                                      msgpack.unpackb(payload, raw=False)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def rebuild(messages) -> tuple[set[int], list[dict]]:
    """The block index a router keeps: hashes stored minus removed, reset on a clear."""
    index: set[int] = set()
    stored = []
    for _, _, (ts, events, rank) in messages:
        assert isinstance(ts, float) and rank == 0
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                n = len(ev["block_hashes"])
                assert len(ev["token_ids"]) == n * ev["block_size"]
                assert ev["parent_block_hash"] is None or ev["parent_block_hash"] in index
                assert ev["medium"] == "GPU" and ev["group_idx"] == 0
                assert len(ev["extra_keys"]) == n
                index.update(ev["block_hashes"])
                stored.append(ev)
            elif kind == "BlockRemoved":
                assert set(ev["block_hashes"]) <= index
                index.difference_update(ev["block_hashes"])
            else:
                assert kind == "AllBlocksCleared"
                index.clear()
    return index, stored


def test_subscriber_rebuilds_the_prefix_cache(tenants, tiny_model_dir):
    # a small cache: the run below must evict cached blocks to make room
    engine = make_engine(tiny_model_dir, max_model_len=512, max_num_seqs=8, max_loras=2,
                         max_cpu_loras=4, num_gpu_blocks=40)
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    app = create_app(settings(kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                              kv_events_topic="kv@pod-0@tiny"),
                     engine=engine, registry=tenants.registry)
    try:
        with serve_in_thread(app) as url:
            time.sleep(0.5)  # the engine's PUB socket connects to the subscriber
            shared = "the same long system prompt for everybody " * 6
            jobs = [("alpha", "shared", shared + "first"), ("alpha", "shared", shared + "second"),
                    ("beta", "shared", shared + "first"), ("alpha", "tiny", shared + "base")]
            jobs += [("beta", "b-only", f"distinct prompt number {i} " * 8) for i in range(16)]
            jobs += [("alpha", "shared", shared + "third")]  # a hit, if it survived
            keys = {"alpha": tenants.alpha_key, "beta": tenants.beta_key}
            for tenant, model, prompt in jobs:
                r = httpx.post(f"{url}/v1/completions", headers=Tenants.auth(keys[tenant]),
                               json={"model": model, "prompt": prompt, "max_tokens": 20,
                                     "ignore_eos": True, "temperature": 0}, timeout=60)
                assert r.status_code == 200, r.text
            stats = engine.stats()
            assert stats.prefix_cache_hits > 0 and stats.prefix_cache_evictions > 0
            publisher = app.services.kv_events
            deadline = time.monotonic() + 10
            while publisher._queue.qsize() or not sub.messages:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            time.sleep(0.3)
            cache = engine.call_sync(lambda: set(engine.engine.kv.pool.cached), timeout=10)
            index, stored = rebuild(sub.messages)
            assert index == {external_hash(k) for k in cache}
            assert publisher.dropped == 0
            r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            assert f"loramux_kv_events_published {float(publisher.published)}" in r.text
            assert "loramux_kv_events_dropped 0.0" in r.text
            seqs = [m[1] for m in sub.messages]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # consecutive
            assert {m[0] for m in sub.messages} == {b"kv@pod-0@tiny"}
            lora_names = {ev["lora_name"] for ev in stored}
            assert lora_names == {"shared", "b-only", None}  # names requests send; base: None
            for ev in stored:
                if ev["lora_name"] is None:
                    assert ev["lora_id"] is None and ev["extra_keys"] == [None] * len(ev["block_hashes"])
                else:
                    assert isinstance(ev["lora_id"], int)
                    assert ev["extra_keys"][0] == [ev["lora_name"]]
            # alpha's and beta's "shared": the same first block of tokens, two hashes
            first = [ev for ev in stored if ev["lora_name"] == "shared"
                     and ev["parent_block_hash"] is None]
            bs = first[0]["block_size"]
            assert len({tuple(ev["token_ids"][:bs]) for ev in first}) == 1
            assert len({ev["block_hashes"][0] for ev in first}) == 2
    finally:
        close_state(app.services)
        sub.close()
        engine.shutdown()


def test_engine_restart_clears_the_index(tiny_model_dir):
    """A new KV cache (engine restart) is announced as AllBlocksCleared."""
    engine = make_engine(tiny_model_dir, max_model_len=256, enable_lora=False, num_gpu_blocks=64)
    port = free_port()
    sub = Subscriber(f"tcp://127.0.0.1:{port}")
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@p@m",
                                 adapter_of=lambda key: (key, 1))
    remove = engine.add_kv_listener(publisher)

    async def run() -> None:
        async for _ in engine.generate("a prompt long enough to fill a few blocks " * 4,
                                       SamplingParams(max_tokens=8)):
            pass

    def kinds() -> list[str]:
        return [ev["type"] for _, _, (_, evs, _) in sub.messages for ev in evs]

    try:
        time.sleep(0.5)
        asyncio.run(run())
        deadline = time.monotonic() + 5
        while "BlockStored" not in kinds():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine.call_sync(engine.engine.reset, timeout=10)
        while kinds()[-1] != "AllBlocksCleared":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        index, stored = rebuild(sub.messages)
        assert stored and index == set()
    finally:
        remove()
        publisher.close()
        sub.close()
        engine.shutdown()


@pytest.mark.latency
def test_a_full_queue_drops_and_counts_without_blocking():
    port = free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", "kv@p@m",
                                 adapter_of=lambda key: (key, 1), max_queue_size=4)
    gate = threading.Event()
    publisher.send = lambda events: gate.wait(10)  # a stalled socket: nothing drains
    try:
        key = bytes(16)
        worst = 0.0
        for _ in range(5000):
            start = time.perf_counter()
            publisher.blocks_stored([key], None, [1] * 16, 16, None)
            worst = max(worst, time.perf_counter() - start)
        assert publisher.dropped >= 5000 - 4 - 1 - 1024
        assert worst < 0.05
    finally:
        gate.set()
        publisher.close()


@pytest.mark.parametrize("endpoint,bind", [("tcp://*:5557", True), ("tcp://[::]:5557", True),
                                           ("ipc:///tmp/x", True), ("tcp://indexer:5557", False)])
def test_bind_or_connect_like_vllm(endpoint, bind):
    from loramux.platform.inference_gateway.kv_events import binds

    assert binds(endpoint) is bind
