"""An all-reduce through shared memory for CPU ranks on one machine (vLLM's CPU backend does
the same in C++): gloo's over loopback TCP takes ~0.5 ms even for a few KiB, and a decode
step runs two per layer.

One segment holds, per rank, two data slots (rounds alternate between them) and a round
counter on its own cache line. Each round a rank copies its tensor into its slot, publishes
the round number, waits (spinning, briefly: the ranks run in lockstep) until every rank has
published it, then sums every rank's slot in rank order (float32 accumulation), so every rank
gets the same bits. Two slots make a barrier after the sums unnecessary: a rank that writes
round ``k + 2`` into a slot has seen every rank publish ``k + 1``, which each did only after
reading round ``k``. A wait longer than ``timeout`` or a peer that exited raises
:class:`CollectiveError`. Tensors larger than a slot go through it in chunks.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time

import numpy as np
import torch

from loramux.engine.errors import CollectiveError

_LINE = 64  # bytes: each rank's counter on its own cache line
SLOT_BYTES = 8 << 20


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


class SharedMemoryReducer:
    """Rank ``rank``'s end of one shared-memory all-reduce among ``world`` ranks."""

    def __init__(self, name: str | None, rank: int, world: int, timeout: float) -> None:
        """``name`` None: create the segment (rank 0; :attr:`name` says what to attach)."""
        size = world * (_LINE + 2 * SLOT_BYTES)
        if name is None:
            name = f"/dev/shm/loramux-tp-{os.getpid()}-{secrets.token_hex(6)}"
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
        else:
            fd = os.open(name, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.name, self.rank, self.world, self.timeout = name, rank, world, timeout
        buf = memoryview(self.map)
        header = np.ndarray((world, _LINE // 8), dtype=np.int64, buffer=buf)
        self.rounds = header[:, 0]
        self.pids = header[:, 1]
        header[rank] = 0
        self.pids[rank] = os.getpid()
        self.data = torch.frombuffer(buf, dtype=torch.uint8, offset=world * _LINE,
                                     count=world * 2 * SLOT_BYTES).view(world, 2, SLOT_BYTES)
        self.round = 0

    def unlink(self) -> None:
        """Remove the segment's name (rank 0, once every rank attached; the mapping stays)."""
        os.unlink(self.name)

    def close(self) -> None:
        self.data = None
        self.rounds = self.pids = None
        try:
            self.map.close()
        except BufferError:  # a view of it is still alive somewhere: the OS unmaps at exit
            pass

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (contiguous, on the CPU) over the ranks, in place; returns it."""
        flat = t.view(-1).view(torch.uint8)
        step = SLOT_BYTES - SLOT_BYTES % t.element_size()
        for start in range(0, flat.numel(), step):
            self._round(flat[start : start + step], t.dtype)
        return t

    def gather_columns(self, part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's ``part`` [B, widths[r]] side by side (None on the others)."""
        rows = part.shape[0]
        sizes = [rows * w * part.element_size() for w in widths]
        mine = part.contiguous().view(-1).view(torch.uint8)
        out = [torch.empty(n, dtype=torch.uint8) for n in sizes] if self.rank == 0 else None
        for start in range(0, max(sizes), SLOT_BYTES):
            self.round += 1
            slot = self.round % 2
            n = max(0, min(SLOT_BYTES, sizes[self.rank] - start))
            self.data[self.rank, slot, :n].copy_(mine[start : start + n])
            self.rounds[self.rank] = self.round
            self._wait()
            if out is not None:
                for r, size in enumerate(sizes):
                    m = max(0, min(SLOT_BYTES, size - start))
                    out[r][start : start + m].copy_(self.data[r, slot, :m])
        if out is None:
            return None
        return torch.cat([o.view(part.dtype).view(rows, w) for o, w in zip(out, widths, strict=True)], 1)

    def _round(self, part: torch.Tensor, dtype: torch.dtype) -> None:
        self.round += 1
        slot = self.round % 2
        n = part.numel()
        self.data[self.rank, slot, :n].copy_(part)
        self.rounds[self.rank] = self.round  # x86 keeps the stores in order: data, then this
        self._wait()
        views = self.data[:, slot, :n].view(dtype)
        acc = views[0].to(torch.float32, copy=True)  # never into the shared slot: others read it
        for r in range(1, self.world):
            acc += views[r]
        part.view(dtype).copy_(acc)

    def _wait(self) -> None:
        rounds, want = self.rounds, self.round
        if rounds.min() >= want:
            return
        started = time.monotonic()
        checked = started
        while rounds.min() < want:
            now = time.monotonic()
            if now - checked > 0.5:
                checked = now
                late = [r for r in range(self.world) if rounds[r] < want]
                if any(self.pids[r] and _dead(int(self.pids[r])) for r in late):
                    raise CollectiveError(f"all-reduce: rank {late[0]} exited")
                if now - started > self.timeout:
                    raise CollectiveError(f"all-reduce: rank {late[0]} stalled for {self.timeout:.0f} s")
                time.sleep(0)
