"""One thread of a server runs OpenMP teams (``engine/omp_threads.py``): a helper thread's torch
work starts no pool of workers, a released thread's workers exit, and the engine's builder
releases its pool."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from loramux.engine import omp_threads

pytestmark = pytest.mark.skipif(not omp_threads.available(), reason="no OpenMP runtime found")


@pytest.fixture
def two_threads():
    """New threads' torch work in teams of two (an earlier test may have left the process at one:
    a tensor-parallel rank takes its share of the cores)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a team needs two CPUs")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _parallel_work() -> None:
    """torch's own parallel loops (their teams follow the thread's OpenMP setting; a BLAS call
    may follow a process-wide count of its own once torch.set_num_threads was called)."""
    a = torch.randn(1024, 1024)
    (a * 2 + 1).to(torch.bfloat16).float().sum()


def _in_thread(fn):
    """``fn()``'s result, run on a new thread; also the threads the process gained meanwhile."""
    out = {}

    def run():
        me = str(threading.get_native_id())
        before = _tasks()
        out["result"] = fn()
        out["new"] = _tasks() - before - {me}

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["result"], out["new"]


def test_a_thread_s_parallel_work_starts_a_pool_unless_confined(two_threads):
    _, new = _in_thread(_parallel_work)
    assert new, "the control: a second thread's parallel region starts pooled workers"

    def confined():
        assert omp_threads.confine_thread()
        _parallel_work()
        return torch.get_num_threads()

    threads, new = _in_thread(confined)
    assert threads == 1
    assert not new


def test_release_pool_ends_the_thread_s_workers(two_threads):
    def work_then_release():
        before = _tasks()
        _parallel_work()
        workers = _tasks() - before
        released = omp_threads.release_pool()
        deadline = time.monotonic() + 5
        while workers & _tasks() and time.monotonic() < deadline:
            time.sleep(0.01)
        return workers, released, workers & _tasks()

    (workers, released, left), _ = _in_thread(work_then_release)
    assert workers and released
    assert not left


def test_single_threaded_block_restores_the_team_size(two_threads):
    def block():
        before = torch.get_num_threads()
        with omp_threads.single_threaded():
            inside = torch.get_num_threads()
            start = _tasks()
            _parallel_work()
            gained = _tasks() - start
        return before, inside, gained, torch.get_num_threads()

    (before, inside, gained, after), _ = _in_thread(block)
    assert inside == 1 and not gained
    assert after == before >= 2


def test_the_async_engine_s_builder_releases_its_pool(monkeypatch, tiny_model_dir):
    from loramux.engine import LLM
    from loramux.engine.async_engine import AsyncEngine

    llm = LLM(model=str(tiny_model_dir), max_model_len=128)
    calls = []
    monkeypatch.setattr(omp_threads, "release_pool", lambda: calls.append(threading.get_ident()) or True)
    engine = AsyncEngine(llm.llm_engine)
    try:
        assert calls == [threading.get_ident()]
    finally:
        engine.shutdown()


def test_the_slot_writer_frees_its_pool_after_each_write(monkeypatch, tiny_model_dir, tmp_path):
    """Two adapters over one slot: the second use of the first comes back from the CPU tier
    through the loader's long-lived slot thread, which frees its pool after the write (the
    disk threads' pools go when they exit)."""
    from support.lora_fixtures import make_peft_adapter

    from loramux.engine import LLM, LoRARequest, SamplingParams

    loras = [LoRARequest(f"a{i}", i + 1, str(make_peft_adapter(tiny_model_dir, tmp_path / f"a{i}", seed=i)))
             for i in range(2)]
    llm = LLM(model=str(tiny_model_dir), max_model_len=128, enable_lora=True, max_loras=1,
              max_cpu_loras=4, max_lora_rank=8)
    released = []
    real = omp_threads.release_pool
    monkeypatch.setattr(omp_threads, "release_pool",
                        lambda: released.append(threading.current_thread().name) or real())
    params = SamplingParams(temperature=0, max_tokens=2)
    for lora in (*loras, loras[0]):
        llm.generate(["hello"], params, lora_request=lora)
    assert any(name.startswith("lora-slot") for name in released), released
