"""Rank 0's side of tensor parallelism: the engine's runner when ``tensor_parallel_size > 1``.

The engine's process is rank 0: it keeps the scheduler, the block manager, the adapter tiers
and the HTTP server, and runs its own share of every step. :class:`WorkerGroup` starts the
other ranks as local processes (``distributed_executor_backend="mp"``: ``python -m
loramux.engine.distributed.worker``, so no caller needs a ``__main__`` guard), waits for
them to load their shares, and joins the group with them. Each step
:class:`TensorParallelRunner` broadcasts the plan (plus the adapter slot writes since the last
step, whole adapters that each rank cuts to its share) before running rank 0's share; the
all-reduces inside the forward pass keep the ranks in step, and rank 0's logits are sampled.

A worker that dies (or a collective that fails or stalls past ``tensor_parallel_timeout``)
fails the step's requests and raises :class:`EngineDeadError` from the step: the engine's
loop restarts, and :meth:`TensorParallelRunner.reset` replaces every worker (their slots are
written again from rank 0's record; the prefix cache starts empty). Workers exit when rank 0
says so, when it goes away (a pipe to it closes, or it was killed), never left behind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist

from loramux.engine import envs
from loramux.engine.config import EngineConfig
from loramux.engine.distributed import group
from loramux.engine.distributed.shm_reduce import SharedMemoryReducer
from loramux.engine.distributed.worker import SlotSetup, WorkerSetup
from loramux.engine.errors import CollectiveError, EngineDeadError, LoRAError
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.runner import ModelRunner, StepAdapters
from loramux.engine.step_data import ModelOutput, SchedulerOutput

logger = logging.getLogger(__name__)


_SOURCE_TREE_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
                     "from bench.source_tree import use_source_tree; use_source_tree(); "
                     "from loramux.engine.distributed.worker import main; main(sys.argv[2:])")


def worker_command(args: str) -> list[str]:
    """The command of a local worker given its JSON ``args``: the installed package's module,
    or, where loramux runs from its checkout (``LORAMUX_SOURCE_TREE``), that tree mapped first."""
    root = envs.LORAMUX_SOURCE_TREE
    if root is None:
        return [sys.executable, "-m", "loramux.engine.distributed.worker", args]
    return [sys.executable, "-c", _SOURCE_TREE_BOOT, root, args]


class WorkerGroup:
    """The ranks 1..N-1 as local processes, and rank 0's membership of their group."""

    def __init__(self, config: EngineConfig, path: str, device: torch.device) -> None:
        self.config, self.path, self.device = config, path, device
        self.world = config.parallel.tensor_parallel_size
        self.timeout = config.parallel.tensor_parallel_timeout
        self.procs: list[subprocess.Popen] = []
        self.control = None
        self.shared_memory: SharedMemoryReducer | None = None
        """Local CPU ranks: the all-reduce's segment."""

    def start(self) -> None:
        """Start the workers, wait until each loaded its share, join the group with them
        (under a launcher the workers are its processes: only join them)."""
        launched = group.launched_rank()
        if launched is not None:
            if launched != (0, self.world):
                raise ValueError(f"RANK, WORLD_SIZE are {launched}: the engine must be rank 0 "
                                 f"of tensor_parallel_size {self.world}")
            group.join(0, self.world, "env://", self.device, self.timeout)
            self.control = group.control_group()
            self.shared_memory = None  # the ranks may sit on several machines
            return
        init = group.rendezvous()
        pipes = []
        for rank in range(1, self.world):
            ours, theirs = os.pipe()
            args = dict(rank=rank, world=self.world, init_method=init, path=self.path,
                        model_config=dataclasses.asdict(self.config.model), timeout=self.timeout,
                        status_fd=theirs, parent=os.getpid())
            self.procs.append(subprocess.Popen(worker_command(json.dumps(args)), pass_fds=(theirs,)))
            os.close(theirs)
            pipes.append(os.fdopen(ours, "rb"))
        deadline = time.monotonic() + self.timeout * 5  # loading the shares may take a while
        for rank, pipe in enumerate(pipes, start=1):
            with pipe:
                line = b""
                while not line and self.procs[rank - 1].poll() is None:
                    if time.monotonic() > deadline:
                        break
                    if select.select([pipe], [], [], 0.2)[0]:
                        line = pipe.readline()
            state = line.decode(errors="replace").strip()
            if state != "loaded":
                self.stop()
                raise EngineDeadError(f"tensor-parallel rank {rank} did not start: "
                                      f"{state or 'it exited or timed out while loading'}")
        group.join(0, self.world, init, self.device, self.timeout)
        self.control = group.control_group()
        if self.device.type == "cpu" and os.path.isdir("/dev/shm"):
            self.shared_memory = SharedMemoryReducer(None, 0, self.world, self.timeout)
            group.use_shared_memory(self.shared_memory)
        logger.info("tensor parallel: %d ranks joined (%s)", self.world, init)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def send(self, message) -> None:
        group.send(message, self.control)

    def set_up(self, setup: WorkerSetup) -> None:
        """Send the workers their setup (with the shared memory's name), wait until they
        attached it, then remove its name (nothing is left in /dev/shm, even on a kill)."""
        shm = self.shared_memory
        self.send(dataclasses.replace(setup, shared_memory=shm.name if shm is not None else None))
        group.barrier(self.control)
        if shm is not None:
            shm.unlink()

    def stop(self) -> None:
        """Tell the workers to leave (when they can hear it), then make sure they are gone."""
        if self.control is not None and self.alive():
            try:
                self.send(None)
            except Exception:  # a worker went away meanwhile: it is killed below
                logger.warning("a tensor-parallel worker did not hear the stop")
        for p in self.procs:
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        self.procs, self.control, self.shared_memory = [], None, None
        group.leave()


def _broken(error: BaseException | None) -> bool:
    """Whether a failed step's error came from the group (a rank gone or stalled)."""
    if error is None:
        return False
    text = str(error).lower()
    if isinstance(error, (dist.DistError, CollectiveError)):
        return True
    return any(w in text for w in ("gloo", "nccl", "connection"))


class TensorParallelRunner:
    """The engine's runner under tensor parallelism (the :class:`ModelRunner` interface)."""

    def __init__(self, model: DecoderModel, num_blocks: int, config: EngineConfig,
                 adapters: StepAdapters, path: str) -> None:
        cc = config.cache
        self.local = ModelRunner(model, num_blocks, cc.block_size, config.model.attention_backend,
                                 adapters=adapters)
        self.adapters = adapters
        buffers = getattr(adapters, "buffers", None)
        slots = SlotSetup.of(buffers, adapters.backend) if buffers is not None else None
        self._setup = WorkerSetup(num_blocks, cc.block_size, slots)
        self._lock = threading.Lock()
        self._ops: list = []
        self._slots: dict[int, object] = {}
        """Each slot's whole adapter as last written (written again into new workers)."""
        if buffers is not None:
            buffers.mirror = self
        base = getattr(adapters, "base_projections", None)
        if base is not None:
            base.gather = self.gather_dora_parts
        self._exchange = threading.Lock()
        """Held while rank 0 talks to its workers (a step, a DoRA exchange): one at a time."""
        self._dora_tokens = 0
        """Numbers each DoRA exchange (its start and its collection)."""
        self.workers = WorkerGroup(config, path, model.device)
        self._finalizer = weakref.finalize(self, self.workers.stop)
        self._start()

    def _start(self) -> None:
        self.workers.start()
        self.workers.set_up(self._setup)

    # --- SlotMirror: rank 0's slot writes, repeated on the workers at the next step ------
    def wrote(self, slot: int, weights) -> None:
        with self._lock:
            self._ops.append(("write", slot, weights))
            self._slots[slot] = weights

    def cleared(self, slot: int) -> None:
        with self._lock:
            self._ops.append(("clear", slot, None))
            self._slots.pop(slot, None)

    # --- the runner's interface -----------------------------------------------------------
    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Send the step to every rank, run rank 0's share, return rank 0's logits. Raises
        :class:`EngineDeadError` when a worker is gone (the step's rows fail with it)."""
        if not self.workers.alive():
            raise EngineDeadError("a tensor-parallel worker died; the engine restarts its workers")
        with self._lock:
            ops, self._ops = self._ops, []
        with self._exchange:
            try:
                self.workers.send(("step", ops, dict(self.adapters.slot_of), plan))
            except Exception as e:
                raise EngineDeadError(f"a tensor-parallel worker cannot be reached: {e}") from e
            output = self.local.execute(plan)
        if _broken(output.error) or (output.error is not None and not self.workers.alive()):
            raise EngineDeadError(f"tensor-parallel step failed: {output.error}") from output.error
        return output

    def gather_dora_parts(self, weights, own_parts) -> list:
        """Every rank's DoRA parts (``dora.RankParts``) of the whole adapter ``weights``, rank 0's
        first (``own_parts()`` computes them). Short exchanges between steps: the first hands
        the adapter to the workers, which compute their parts on a thread beside their steps
        while rank 0 computes its own; polls (a flag per rank) wait until every rank is done;
        the last collects them. No step waits for any rank's computation. Called from a load
        thread; raises :class:`LoRAError` when a worker cannot answer or has not finished within
        ``tensor_parallel_timeout`` (the workers then drop the exchange)."""
        with self._lock:
            self._dora_tokens += 1
            token = self._dora_tokens
        self._dora_exchange(("dora", token, weights))
        try:
            own = own_parts()
        except Exception as e:  # the workers still hand in theirs: none is left behind
            self._dora_exchange(("dora-collect", token), f"{type(e).__name__}: {e}")
            raise
        pause, deadline = 0.001, time.monotonic() + self.workers.timeout
        while not all(self._dora_exchange(("dora-poll", token), True)):
            if time.monotonic() > deadline:  # a stalled worker: give up on this adapter only
                self._dora_exchange(("dora-drop", token))
                raise LoRAError(f"the tensor-parallel workers did not compute a DoRA adapter's norms "
                                f"within tensor_parallel_timeout ({self.workers.timeout:g} s)")
            time.sleep(pause)  # the steps run meanwhile
            pause = min(2 * pause, 0.05)
        return self._dora_exchange(("dora-collect", token), own)

    def _dora_exchange(self, message, own=None) -> list | None:
        """Send ``message`` between two steps; with ``own``, gather every rank's answer."""
        with self._exchange:
            try:
                self.workers.send(message)
                return None if own is None else group.gather_objects(own, self.workers.control)
            except Exception as e:
                raise LoRAError(f"the tensor-parallel workers could not scale a DoRA adapter: {e}") from e

    def reset(self) -> None:
        """Replace every worker (after the engine's loop died): new processes, a new group,
        the slots written again."""
        with self._exchange:
            self.workers.stop()
            with self._lock:
                self._ops = [("write", slot, w) for slot, w in self._slots.items()]
            self._start()

    def shutdown(self) -> None:
        """Stop the workers now (also done when the runner is collected and at exit)."""
        self._finalizer()


def make_runner(model: DecoderModel, num_blocks: int, config: EngineConfig,
                adapters: StepAdapters, path: str) -> ModelRunner | TensorParallelRunner:
    """The engine's runner: one process, or rank 0 of ``tensor_parallel_size`` ranks."""
    if config.parallel.tensor_parallel_size == 1:
        return ModelRunner(model, num_blocks, config.cache.block_size,
                           config.model.attention_backend, adapters=adapters)
    return TensorParallelRunner(model, num_blocks, config, adapters, str(path))
