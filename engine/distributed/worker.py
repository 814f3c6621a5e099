"""A tensor-parallel rank other than 0: it loads its share of the model, joins the group,
then runs every step rank 0 broadcasts (the same ``SchedulerOutput`` rank 0 runs, plus the
adapter slot writes since the last step) until rank 0 says stop or goes away.

It holds no scheduler, block manager or adapter tiers: rank 0 decides, this rank repeats
(its KV cache holds its KV heads; its slots its share of each adapter). Logits are computed
on rank 0 alone's use: a worker's are dropped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from loramux.engine import omp_threads
from loramux.engine.config import ModelConfig
from loramux.engine.distributed import group
from loramux.engine.distributed.shm_reduce import SharedMemoryReducer
from loramux.engine.loading import resolve_device, resolve_dtype
from loramux.engine.lora.dora import BaseProjections
from loramux.engine.lora.slots import SlotBuffers
from loramux.engine.lora.step import LoRAStepBatch, lay_out_step
from loramux.engine.model.decoder import DecoderModel
from loramux.engine.model.registry import load_model
from loramux.engine.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SlotSetup:
    """Rank 0's adapter slots, for a worker to build its share of the same slots."""

    max_loras: int
    max_rank: int
    dtype: torch.dtype
    scale_dtype: torch.dtype
    blockdiag: bool
    backend: str
    fully_sharded: bool = False

    @classmethod
    def of(cls, buffers: SlotBuffers, backend: str) -> SlotSetup:
        return cls(buffers.max_loras, buffers.max_rank, buffers.dtype, buffers.scale_dtype,
                   buffers.blockdiag, backend, buffers.fully_sharded)


@dataclass(frozen=True)
class WorkerSetup:
    """What rank 0 sends once its workers joined: the KV pool and the adapter slots."""

    num_blocks: int
    block_size: int
    slots: SlotSetup | None
    shared_memory: str | None = None
    """The all-reduce's shared-memory segment (CPU ranks on one machine; None: gloo's)."""


class FollowerAdapters:
    """A worker's adapter slots (``StepAdapters``): rank 0's writes applied to this rank's
    share, laid out per step by rank 0's slot table."""

    def __init__(self, model: DecoderModel, setup: SlotSetup) -> None:
        self.buffers = SlotBuffers(model.local_dims, setup.max_loras, setup.max_rank, setup.dtype,
                                   model.device, blockdiag=setup.blockdiag,
                                   scale_dtype=setup.scale_dtype, shard=model.shard,
                                   fully_sharded=setup.fully_sharded)
        self.buffers.norms.base = model.norm_weights()
        self.hook = LoRAStepBatch(self.buffers, setup.backend, model.device)
        self.base = BaseProjections(model)
        self.slot_of: dict[str, int] = {}
        self._dora: dict[int, Future] = {}
        self._dora_pool = ThreadPoolExecutor(1, thread_name_prefix="dora-parts",
                                             initializer=omp_threads.confine_thread)

    def start_dora_parts(self, token: int, weights) -> None:
        """Start computing this rank's DoRA parts of the whole adapter ``weights`` (its share's)
        on a thread beside the steps; :meth:`send_dora_parts` hands them in."""
        self._dora[token] = self._dora_pool.submit(self.base.parts, weights)

    def send_dora_done(self, token: int, control) -> None:
        """Tell rank 0 whether the parts started as ``token`` are computed (or cannot be)."""
        future = self._dora.get(token)
        group.gather_objects(future is None or future.done(), control)

    def drop_dora(self, token: int) -> None:
        """Forget the parts started as ``token`` (rank 0 stopped waiting for them)."""
        self._dora.pop(token, None)

    def send_dora_parts(self, token: int, control) -> None:
        """Send rank 0 the parts started as ``token`` once computed (the text of the error when
        they could not be: rank 0 refuses the adapter)."""
        future = self._dora.pop(token, None)
        try:
            if future is None:
                raise RuntimeError(f"this rank was never handed DoRA exchange {token} (restarted since)")
            parts = future.result()
        except Exception as e:  # rank 0 waits for every rank's answer
            parts = f"{type(e).__name__}: {e}"
        group.gather_objects(parts, control)

    def apply(self, ops: list, slot_of: dict[str, int]) -> None:
        """Rank 0's slot writes and clears since the last step, then its slot table."""
        for op, slot, weights in ops:
            if op == "write":
                self.buffers.write(slot, weights)
            else:
                self.buffers.clear(slot)
        self.slot_of = slot_of

    def prepare_step(self, row_lora_keys, row_num_tokens) -> None:
        lay_out_step(self.buffers, self.hook, self.slot_of, row_lora_keys, row_num_tokens)

    def finish_step(self) -> None:
        self.hook.clear()


def _exit_with_parent(parent: int) -> None:
    """Leave when the process that started this one is gone (it was killed: no goodbye)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _report(status: int | None, line: str) -> None:
    if status is not None:
        os.write(status, (line.replace("\n", " ") + "\n").encode())
        os.close(status)


def run_worker(rank: int, world: int, init_method: str, mc: ModelConfig, path: str,
               timeout: float, status: int | None = None, parent: int | None = None) -> None:
    """A worker's life: load rank ``rank``'s share, join the group at ``init_method``, run
    steps. ``status``: a pipe's file descriptor that hears ``loaded`` or ``failed: <why>``
    (one line); ``parent``: the pid to exit with (local workers)."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    if parent is not None:
        _exit_with_parent(parent)
    try:
        device = group.device_of(rank, resolve_device(mc.device))
        if device.type == "cpu":
            torch.set_num_threads(group.cpu_threads(world))
        dtype = resolve_dtype(mc.dtype, device, Path(path))
        model = load_model(path, dtype, device, enforce_eager=mc.enforce_eager,
                           quantization=mc.quantization, tensor_parallel=(rank, world))
    except BaseException as e:
        _report(status, f"failed: {type(e).__name__}: {e}")
        raise
    _report(status, "loaded")
    group.join(rank, world, init_method, device, timeout)
    control = group.control_group()
    setup: WorkerSetup = group.receive(control)
    if setup.shared_memory is not None:
        group.use_shared_memory(SharedMemoryReducer(setup.shared_memory, rank, world, timeout))
    group.barrier(control)  # every rank attached: rank 0 removes the segment's name
    adapters = FollowerAdapters(model, setup.slots) if setup.slots is not None else None
    runner = ModelRunner(model, setup.num_blocks, setup.block_size, mc.attention_backend, adapters)
    logger.info("rank %d of %d ready: %d KV blocks", rank, world, setup.num_blocks)
    try:
        while (message := group.receive(control)) is not None:
            if message[0] == "dora":
                adapters.start_dora_parts(message[1], message[2])
                continue
            if message[0] == "dora-poll":
                adapters.send_dora_done(message[1], control)
                continue
            if message[0] == "dora-drop":  # rank 0 gave up on it: its result is never sent
                adapters.drop_dora(message[1])
                continue
            if message[0] == "dora-collect":
                adapters.send_dora_parts(message[1], control)
                continue
            _, ops, slot_of, plan = message
            if adapters is not None:
                adapters.apply(ops, slot_of)
            runner.execute(plan)
    finally:
        group.leave()


def run_launched_worker(mc: ModelConfig, timeout: float) -> bool:
    """Under a launcher (torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
    a rank other than 0 runs as a worker until rank 0 stops (True); else nothing (False)."""
    from loramux.engine.loading import model_folder

    launched = group.launched_rank()
    if launched is None or launched[0] == 0:
        return False
    run_worker(launched[0], launched[1], "env://", mc, str(model_folder(mc.model)), timeout)
    return True


def main(argv: list[str] | None = None) -> None:
    """``python -m loramux.engine.distributed.worker '<json>'``: a local worker as rank 0
    starts it (the JSON: rank, world, init_method, model_config, path, timeout, status_fd,
    parent)."""
    args = json.loads((argv if argv is not None else sys.argv[1:])[0])
    run_worker(args["rank"], args["world"], args["init_method"], ModelConfig(**args["model_config"]),
               args["path"], args["timeout"], args.get("status_fd"), args.get("parent"))


if __name__ == "__main__":
    main()
