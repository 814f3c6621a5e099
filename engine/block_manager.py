"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts.

Blocks are numbered 0..num_blocks-1; token ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the cache.
Reference counts let several sequences share a block (copy-on-write sharing).
"""

from __future__ import annotations

from collections import deque

from loramux.engine.sequence import Sequence


class OutOfBlocksError(RuntimeError):
    """The pool has fewer free blocks than asked for."""


class BlockPool:
    """Free list plus a reference count per block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each)."""
        if n > len(self._free):
            raise OutOfBlocksError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, block: int) -> None:
        """Add a reference to an allocated block."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop a reference; the block returns to the free list at zero."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} released more often than allocated")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class KVCacheManager:
    """Grows and frees the block tables of sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

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
        """Blocks ``seq`` still needs to hold ``num_new_tokens`` more computed tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= self.pool.num_free

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend ``seq.block_table`` to cover ``num_new_tokens`` more tokens."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n:
            seq.block_table.extend(self.pool.allocate(n))

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq`` (finish, abort or preemption)."""
        for b in seq.block_table:
            self.pool.release(b)
        seq.block_table = []
        seq.num_computed_tokens = 0
