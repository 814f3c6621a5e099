"""The ranks' process group on torch.distributed: gloo on the CPU, NCCL on CUDA.

Rank 0 (the engine's process) is the rendezvous: its ``tcp://`` address and a free port,
or, when ``MASTER_ADDR`` / ``MASTER_PORT`` are set (torchrun, a multi-node launch), the
standard ``env://`` rendezvous. On the CPU the cores are split between the ranks.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from loramux.engine.distributed.shm_reduce import SharedMemoryReducer


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_rank() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` when a launcher (torchrun, one process per rank, possibly on
    several nodes) started this process; None otherwise."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return None
    return int(rank), int(world)


def rendezvous() -> str:
    """The init method for a new group: ``env://`` under torchrun (``MASTER_ADDR`` and
    ``MASTER_PORT`` set), else a local TCP address on a free port."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        return "env://"
    return f"tcp://127.0.0.1:{free_port()}"


def device_of(rank: int, device: torch.device) -> torch.device:
    """Rank ``rank``'s device: ``cuda:<rank>`` on CUDA (one GPU per rank), else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def cpu_threads(world: int) -> int:
    """Intra-op threads per rank: the CPUs this process may use, split evenly."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cpus or 1) // world)


def join(rank: int, world: int, init_method: str, device: torch.device, timeout: float) -> None:
    """Join the group as ``rank`` (blocks until every rank has joined, at most ``timeout``)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))


def leave() -> None:
    """Leave the group (no-op when this process is in none), and its shared memory."""
    global _reducer
    if _reducer is not None:
        _reducer.close()
        _reducer = None
    if dist.is_initialized():
        dist.destroy_process_group()


_reducer: SharedMemoryReducer | None = None


def use_shared_memory(reducer: SharedMemoryReducer | None) -> None:
    """Make :func:`all_reduce` go through ``reducer`` (CPU ranks on one machine; None: the
    process group's backend)."""
    global _reducer
    _reducer = reducer


_reduce_seconds = 0.0


def reduce_seconds() -> float:
    """Seconds this process spent in :func:`all_reduce` so far (the communication and the
    wait for slower ranks; benchmarks read it)."""
    return _reduce_seconds


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the ranks, in place; returns it."""
    global _reduce_seconds
    started = time.perf_counter()
    if _reducer is not None:
        _reducer.all_reduce(t)
    else:
        dist.all_reduce(t)
    _reduce_seconds += time.perf_counter() - started
    return t


_FOREVER = timedelta(days=365)


def control_group():
    """A gloo group for rank 0's messages (every rank calls it, in the same order): workers
    wait on it for the next step as long as the engine is idle, so it never times out."""
    return dist.new_group(backend="gloo", timeout=_FOREVER)


def send(message, control) -> None:
    """Rank 0: broadcast a picklable ``message`` to every rank of ``control``."""
    dist.broadcast_object_list([message], src=0, group=control)


def receive(control):
    """A worker: the next message rank 0 broadcasts on ``control`` (blocks until it comes)."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


def gather_objects(obj, control) -> list | None:
    """Every rank's picklable ``obj`` on rank 0 (in rank order; None elsewhere)."""
    box = [None] * dist.get_world_size(control) if dist.get_rank(control) == 0 else None
    dist.gather_object(obj, box, dst=0, group=control)
    return box


def gather_columns(part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
    """Rank 0: every rank's ``part`` [B, widths[r]] side by side, ``[B, sum(widths)]``;
    the other ranks: None (they send theirs)."""
    rank = dist.get_rank()
    if _reducer is not None:
        return _reducer.gather_columns(part, widths)
    most = max(widths)
    padded = torch.zeros(part.shape[0], most, dtype=part.dtype, device=part.device)
    padded[:, : part.shape[1]] = part
    parts = [torch.empty_like(padded) for _ in widths] if rank == 0 else None
    dist.gather(padded, parts, dst=0)
    return torch.cat([p[:, :w] for p, w in zip(parts, widths, strict=True)], 1) if rank == 0 else None


def barrier(control) -> None:
    """Every rank of ``control`` reached this point."""
    dist.barrier(group=control)
