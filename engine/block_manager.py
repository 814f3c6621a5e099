"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts,
an adapter-aware prefix cache, and copy-on-write sharing.

Blocks are numbered 0..num_blocks-1; token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the cache. The cache
holds one more slot, :func:`pad_slot` (``num_blocks * block_size``), that no block table
maps and nothing writes: it stays zero, and padded attention positions read it, never
another sequence's keys and values (a masked NaN/Inf still poisons attention).

Prefix cache: a full, computed block is keyed by a hash chain over its tokens, the
key of the block before it and the sequence's adapter identity (``adapter_id``: the
caller's tenant + adapter version; LoRA changes K and V, so two adapters, or two
versions of one, never share a block). An activated LoRA's blocks wholly before its
start (``Sequence.lora_start``, its invocation) hold the base model's K and V and are
keyed as the base's (``base_cache_id``): base requests, other aLoRAs and later turns share
them; its later blocks carry the start in their identity. A block whose last reference is dropped
keeps its key and waits in an LRU list of cached free blocks; a new sequence whose
leading blocks match takes them back instead of recomputing them, and when the
pool runs dry the least recently freed cached block is evicted and reused.

Copy-on-write: forks (``n``, ``best_of``) share their parent's blocks; before a
sequence writes into a block someone else also references, it gets a private
copy (the runner copies the contents, see :attr:`SchedulerOutput.copies`).

Listeners (:class:`KVEventListener`) hear the prefix cache change: keys stored, keys
evicted, and the whole cache cleared (a new manager starts empty); a KV-event publisher
rebuilds the cache's key set from them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from loramux.engine.errors import OutOfBlocksError
from loramux.engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Counters since start; ``queries``/``hits`` count blocks a new sequence could have reused."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVEventListener(Protocol):
    """Hears the prefix cache's keys change. Called on the engine thread inside the step:
    keep it quick and never block (queue the event and return)."""

    def blocks_stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int],
                      block_size: int, lora_key: str | None) -> None:
        """Full blocks of one sequence got keys (:func:`block_key`), in chain order;
        ``parent`` is the key before the first (None at the start of a prompt),
        ``token_ids`` the blocks' tokens, ``lora_key`` the blocks' adapter (None = base: also
        an activated LoRA's blocks before its invocation, which are the base's)."""

    def blocks_removed(self, keys: list[bytes]) -> None:
        """These keys left the cache (their blocks were evicted for reuse)."""

    def all_blocks_cleared(self) -> None:
        """The cache holds no keys (a new manager: start or engine restart)."""


class BlockPool:
    """Free lists plus a reference count per block, and the prefix cache's key maps."""

    on_removed: Callable[[list[bytes]], None] | None = None
    """Called with the keys an :meth:`allocate` evicted (set by the manager)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # free, holding no cached KV
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, cached: LRU first
        self._refs = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # block key -> block
        self._key_of: dict[int, bytes] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_cached)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), evicting cached ones LRU when needed."""
        if n > self.num_free:
            raise OutOfBlocksError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        removed = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._free_cached.popitem(last=False)
                key = self._key_of.pop(b)
                del self.cached[key]
                removed.append(key)
                self.evictions += 1
            self._refs[b] = 1
            blocks.append(b)
        if removed and self.on_removed is not None:
            self.on_removed(removed)
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to a block; a cached free block comes back into use."""
        if self._refs[block] == 0:
            if block not in self._free_cached:
                raise ValueError(f"block {block} is not allocated")
            del self._free_cached[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop a reference; at zero the block is free (cached ones keep their key)."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} released more often than allocated")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if block in self._key_of:
                self._free_cached[block] = None
            else:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def is_free(self, block: int) -> bool:
        return self._refs[block] == 0

    def register(self, block: int, key: bytes) -> bool:
        """Key a full, computed block; a key already held by another block is left there.
        True when the key is new to the cache."""
        if key not in self.cached and block not in self._key_of:
            self.cached[key] = block
            self._key_of[block] = key
            return True
        return False


def pad_slot(num_blocks: int, block_size: int) -> int:
    """The dedicated zeroed cache slot padded attention positions read (after the last block)."""
    return num_blocks * block_size


def block_key(parent: bytes, tokens: list[int], adapter: str | None) -> bytes:
    """Hash-chain key of a full block: its tokens, the key before it, the adapter identity."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"\x00" if adapter is None else b"\x01" + adapter.encode() + b"\x00")
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in tokens))
    return h.digest()


class KVCacheManager:
    """Grows, shares and frees the block tables of sequences."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 listeners: list[KVEventListener] | None = None) -> None:
        """``listeners``: kept by reference (the engine hands the same list to the manager it
        rebuilds on restart); each hears ``all_blocks_cleared`` now: a new cache is empty."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()
        self.listeners: list[KVEventListener] = listeners if listeners is not None else []
        self.pool.on_removed = self._removed
        for listener in tuple(self.listeners):
            listener.all_blocks_cleared()

    def add_listener(self, listener: KVEventListener) -> Callable[[], None]:
        """Hear the prefix cache's keys change; returns the function that removes it."""
        listeners = self.listeners
        listeners.append(listener)
        return lambda: listeners.remove(listener) if listener in listeners else None

    def _removed(self, keys: list[bytes]) -> None:
        for listener in tuple(self.listeners):
            listener.blocks_removed(keys)

    @property
    def pad_slot(self) -> int:
        """The zeroed slot padding reads (see :func:`pad_slot`)."""
        return pad_slot(self.pool.num_blocks, self.block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` still needs to hold ``num_new_tokens`` more computed tokens
        (a shared block it writes into counts: it gets a private copy)."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table)) + int(self._shared_tail(seq, num_new_tokens))

    def _shared_tail(self, seq: Sequence, num_new_tokens: int) -> bool:
        """True when the next token lands in a partial block that another sequence references."""
        pos = seq.num_computed_tokens
        if num_new_tokens == 0 or pos % self.block_size == 0:
            return False
        return self.pool.ref_count(seq.block_table[pos // self.block_size]) > 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int, copies: list[tuple[int, int]] | None = None) -> None:
        """Extend ``seq.block_table`` to cover ``num_new_tokens`` more tokens; a shared partial
        block about to be written is replaced by a fresh one, and (old, new) is appended to
        ``copies`` for the runner to copy before the step."""
        if self._shared_tail(seq, num_new_tokens):
            i = seq.num_computed_tokens // self.block_size
            old = seq.block_table[i]
            (new,) = self.pool.allocate(1)
            self.pool.release(old)
            seq.block_table[i] = new
            if copies is None:
                raise ValueError("a copy-on-write allocation needs a copies list")
            copies.append((old, new))
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        n = max(0, needed - len(seq.block_table))
        if n:
            seq.block_table.extend(self.pool.allocate(n))

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finish, abort or preemption)."""
        for b in reversed(seq.block_table):  # tail blocks first: the LRU evicts them first
            self.pool.release(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past ``seq``'s computed tokens: those only rejected draft tokens
        used (speculative decoding), fresh and never keyed. Called after a verify step."""
        keep = self.blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the blocks and computed tokens of ``parent`` (shared, copy-on-write)."""
        for b in parent.block_table:
            self.pool.share(b)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_keys = list(parent.block_keys)
        child.num_registered_blocks = parent.num_registered_blocks

    # --- prefix cache -------------------------------------------------------------
    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Keys of ``seq``'s first ``num_blocks`` full blocks (memoized on the sequence)."""
        keys = seq.block_keys
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            keys.append(block_key(keys[-1] if keys else b"", seq.token_ids[i * bs : (i + 1) * bs],
                                  self._identity(seq, i)))
        return keys[:num_blocks]

    def _identity(self, seq: Sequence, block: int) -> str | None:
        """The identity block ``block`` of ``seq`` is keyed with: the base model's when it
        lies wholly before the adapter's start (an activated LoRA's context before its
        invocation: a base request, another aLoRA and the next turn share it), else the
        sequence's adapter's."""
        if (block + 1) * self.block_size <= seq.lora_start:
            return seq.base_cache_id
        return seq.adapter_id

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks (at least its last token is
        left to compute). Called when a sequence with nothing computed is admitted."""
        if not self.enable_prefix_caching or seq.block_table or seq.params.prompt_logprobs is not None:
            return []
        candidates = (seq.num_tokens - 1) // self.block_size
        found = []
        for key in self._keys(seq, candidates):
            b = self.pool.cached.get(key)
            if b is None:
                break
            found.append(b)
        return found

    def can_allocate_with_prefix(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Room for ``num_new_tokens`` after the cached blocks, counting cached free ones taken."""
        revived = sum(1 for b in cached if self.pool.is_free(b))
        total = len(cached) * self.block_size + num_new_tokens
        return self.blocks_for(total) - len(cached) + revived <= self.pool.num_free

    def take_prefix(self, seq: Sequence, cached: list[int]) -> None:
        """Start ``seq`` after its cached blocks and count the lookup in the stats."""
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None:
            self.stats.queries += (seq.num_tokens - 1) // self.block_size
            self.stats.hits += len(cached)
        for b in cached:
            self.pool.share(b)
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_registered_blocks = len(cached)
        if seq.num_cached_tokens is None:  # what the first admission found (vLLM's count)
            seq.num_cached_tokens = seq.num_computed_tokens

    def register_computed(self, seq: Sequence) -> None:
        """Key the blocks of ``seq`` that became full and computed; called after each step."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        keys = self._keys(seq, full)
        stored = [i for i in range(seq.num_registered_blocks, full)
                  if self.pool.register(seq.block_table[i], keys[i])]
        seq.num_registered_blocks = full
        if stored and self.listeners:
            self._stored(seq, keys, stored)

    def _stored(self, seq: Sequence, keys: list[bytes], stored: list[int]) -> None:
        """Tell the listeners, one call per run of consecutive newly keyed blocks."""
        bs = self.block_size
        start = 0
        for j in range(1, len(stored) + 1):
            if j < len(stored) and stored[j] == stored[j - 1] + 1:
                continue
            first, last = stored[start], stored[j - 1]
            # the blocks before an aLoRA's start are the base model's: a run of its own
            split = min(max(seq.lora_start // bs, first), last + 1) if seq.lora_key is not None else first
            for lo, hi, key in ((first, split, None), (split, last + 1, seq.lora_key)):
                if lo < hi:
                    for listener in tuple(self.listeners):
                        listener.blocks_stored(keys[lo:hi], keys[lo - 1] if lo else None,
                                               seq.token_ids[lo * bs:hi * bs], bs, key)
            start = j
