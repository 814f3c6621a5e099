"""Prefix-cache KV events over ZeroMQ, in vLLM's wire format (``--kv-events-endpoint``),
for llm-d's precise prefix-cache routing.

Every message is three frames: the topic (``kv@<pod>@<model>`` by default), an 8-byte
big-endian sequence number (0, 1, 2, ... per publisher) and a msgpack payload, the batch
``[ts, [event, ...], data_parallel_rank]``. Events are maps tagged by ``type`` (vLLM
>= 0.26; llm-d-kv-cache >= 0.9 reads them):

* ``BlockStored``: ``block_hashes`` (the low 64 bits of each block's key, unsigned: vLLM's
  integer form), ``parent_block_hash`` (None at a prompt's start), ``token_ids`` (the
  blocks' tokens), ``block_size``, ``lora_id``, ``lora_name`` (the name requests send in
  ``model``; None for the base model), ``medium`` ``"GPU"`` (the engine's KV cache, on a
  CPU engine too), ``extra_keys`` (per block ``[lora_name]`` or None), ``group_idx`` 0,
  ``kv_cache_spec_kind`` ``"full_attention"``;
* ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
* ``AllBlocksCleared``: the cache is empty (published at start and on an engine restart).

The engine calls the listener methods inside its step (``KVEventListener``); they only
queue. A publisher thread batches whatever is queued and sends it. The queue is bounded:
when it is full the event is dropped and counted (:attr:`KVEventPublisher.dropped`),
the step never waits. Hash keys carry the tenant and adapter version, so two tenants'
blocks never share a hash even when their ``lora_name`` is the same.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

import msgpack
import zmq

logger = logging.getLogger(__name__)

MEDIUM = "GPU"
"""vLLM's name of the engine's own KV cache (``MEDIUM_GPU``)."""
MAX_BATCH = 1024
"""Most events in one message."""


def external_hash(key: bytes) -> int:
    """A block key (16-byte digest) as vLLM's integer block hash: its low 64 bits."""
    return int.from_bytes(key[-8:], "big")


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an endpoint with a wildcard (``tcp://*:5557``), ``ipc://`` or
    ``inproc://``; connect to any other (``tcp://indexer:5557``)."""
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class KVEventPublisher:
    """A ``KVEventListener`` that publishes what it hears (see the module docstring)."""

    def __init__(self, endpoint: str, topic: str, *,
                 adapter_of: Callable[[str], tuple[str, int]],
                 max_queue_size: int = 100_000, hwm: int = 100_000,
                 context: zmq.Context | None = None) -> None:
        """``adapter_of``: engine adapter key -> (lora_name, lora_id). Binds or connects
        now (raises ``zmq.ZMQError`` for a bad or busy endpoint); publishes
        ``AllBlocksCleared`` first."""
        self.endpoint, self.topic = endpoint, topic.encode()
        self.adapter_of = adapter_of
        self.dropped = 0
        """Events dropped because the queue was full."""
        self.published = 0
        """Messages sent."""
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._seq = 0
        self._stop = threading.Event()
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        (self._socket.bind if binds(endpoint) else self._socket.connect)(endpoint)
        self.all_blocks_cleared()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # --- the listener (engine thread: queue and return) ---------------------------------
    def _put(self, event: tuple) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def blocks_stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int],
                      block_size: int, lora_key: str | None) -> None:
        self._put(("stored", keys, parent, token_ids, block_size, lora_key))

    def blocks_removed(self, keys: list[bytes]) -> None:
        self._put(("removed", keys))

    def all_blocks_cleared(self) -> None:
        self._put(("cleared",))

    # --- the publisher thread -----------------------------------------------------------
    def _event(self, item: tuple) -> dict:
        kind = item[0]
        if kind == "stored":
            _, keys, parent, token_ids, block_size, lora_key = item
            name, lora_id = self.adapter_of(lora_key) if lora_key is not None else (None, None)
            return {
                "type": "BlockStored",
                "block_hashes": [external_hash(k) for k in keys],
                "parent_block_hash": external_hash(parent) if parent is not None else None,
                "token_ids": token_ids, "block_size": block_size,
                "lora_id": lora_id, "medium": MEDIUM, "lora_name": name,
                "extra_keys": [[name] if name is not None else None for _ in keys],
                "group_idx": 0, "kv_cache_spec_kind": "full_attention",
            }
        if kind == "removed":
            return {"type": "BlockRemoved", "block_hashes": [external_hash(k) for k in item[1]],
                    "medium": MEDIUM, "group_idx": 0}
        return {"type": "AllBlocksCleared"}

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                items = [self._queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(items) < MAX_BATCH:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self.send([self._event(i) for i in items])
            except Exception:
                logger.exception("KV events: a batch of %d events could not be sent", len(items))
                time.sleep(0.1)

    def send(self, events: list[dict]) -> None:
        """One message: topic, sequence number, ``[ts, events, 0]`` (publisher thread)."""
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        self._socket.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1
        self.published += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to ``timeout``), then close the socket."""
        self._stop.set()
        self._thread.join(timeout)
        with contextlib.suppress(Exception):
            self._socket.close(linger=0)
