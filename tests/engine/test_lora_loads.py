"""Cold adapter loads on the loader's pool (tiny model): several at once, no more than
``lora_load_workers``, the queue in admission's fair order, a failure only its own.

Loads are held open by a gated adapter source (events, no sleeps): the engine thread's
calls (registration) pass at once; a loader thread's call records the name and waits for
the test to open that adapter's gate."""

from __future__ import annotations

import threading

import pytest
from support.lora_fixtures import make_peft_adapter

NAMES = [f"s{i}" for i in range(6)] + ["n0", "bad"]


class GatedSource:
    """Adapter source (name → folder) whose loads wait for :meth:`open`."""

    def __init__(self, folders: dict) -> None:
        self.folders = folders
        self.started: list[str] = []
        self.fail: set[str] = set()
        self._gates = {name: threading.Event() for name in folders}
        self._cond = threading.Condition()

    def __call__(self, name: str):
        if threading.current_thread().name.startswith("lora-disk"):
            with self._cond:
                self.started.append(name)
                self._cond.notify_all()
            assert self._gates[name].wait(60), f"the test never opened {name}"
            if name in self.fail:
                raise OSError(f"{name}: the disk went away")
        return self.folders[name]

    def open(self, *names: str) -> None:
        for name in names:
            self._gates[name].set()

    def wait_started(self, count: int) -> list[str]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.started) >= count, timeout=60), self.started
            return list(self.started)

    def running(self) -> list[str]:
        """Started loads whose gate is still shut (they hold a worker)."""
        return [n for n in self.started if not self._gates[n].is_set()]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("gated-adapters")
    return {name: make_peft_adapter(tiny_model_dir, root / name, r=4, target_modules=["q_proj", "v_proj"],
                                    seed=i, std=0.2)
            for i, name in enumerate(NAMES)}


@pytest.fixture
def source(folders):
    src = GatedSource(folders)
    yield src
    src.open(*NAMES)  # no loader thread is left waiting


def _engine(tiny_model_dir, source, **kw):
    from loramux.engine import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, enable_lora=True,
              max_lora_rank=8, adapter_source=source, **kw)
    return llm.llm_engine


def _requests(names):
    from loramux.engine import LoRARequest

    return {name: LoRARequest(name, i + 1) for i, name in enumerate(names)}


def test_several_cold_loads_run_at_once_and_no_more_than_the_workers(tiny_model_dir, source):
    manager = _engine(tiny_model_dir, source, lora_load_workers=3).lora_manager
    loras = _requests(NAMES[:5])
    for lora in loras.values():
        manager.register(lora)
        assert not manager.acquire(lora.key, set())
    # three loads are inside the source at once, none finished: they run concurrently
    assert sorted(source.wait_started(3)) == ["s0", "s1", "s2"]
    assert manager.tiers.queued_loads() == ["s3", "s4"]
    assert all(manager.is_loading(k) for k in loras)
    source.open("s0")
    assert source.wait_started(4)[3] == "s3"  # the freed worker takes the next one
    assert len(source.running()) == 3 and manager.tiers.queued_loads() == ["s4"]
    source.open(*loras)
    for _ in range(400):
        manager.poll(wait=0.05)
        if all(manager.acquire(k, set()) for k in loras):
            break
    assert set(manager.slot_of) == set(loras)
    assert manager.load_stats.loads["store"] == 5 and manager.load_stats.loads["disk"] == 5


def test_in_flight_loads_are_capped_by_the_cpu_tier(tiny_model_dir, source):
    from loramux.engine.config import LoRAConfig

    manager = _engine(tiny_model_dir, source, lora_load_workers=8, max_loras=1,
                      max_cpu_loras=2).lora_manager
    assert manager.tiers.load_workers == 2
    for lora in _requests(NAMES[:4]).values():
        manager.register(lora)
        manager.acquire(lora.key, set())
    source.wait_started(2)
    assert len(source.running()) == 2 and manager.tiers.queued_loads() == ["s2", "s3"]
    with pytest.raises(ValueError, match="lora_load_workers"):
        LoRAConfig(lora_load_workers=0)


def test_a_neighbours_cold_load_starts_before_a_sprayers_queued_ones(tiny_model_dir, source):
    from loramux.engine import SamplingParams

    engine = _engine(tiny_model_dir, source, lora_load_workers=2)
    params = SamplingParams(temperature=0, max_tokens=2)
    loras = _requests(NAMES[:7])
    for i in range(6):  # the sprayer: six cold adapters at once
        engine.add_request(f"spray{i}", "Hello there", params, loras[f"s{i}"], fairness_key="sprayer")
    engine.step()
    assert sorted(source.wait_started(2)) == ["s0", "s1"]
    assert engine.lora_manager.tiers.queued_loads() == ["s2", "s3", "s4", "s5"]
    engine.add_request("neighbour", "Hello there", params, loras["n0"], fairness_key="neighbour")
    engine.step()  # the neighbour's one load goes ahead of the sprayer's queued four
    assert engine.lora_manager.tiers.queued_loads()[0] == "n0"
    source.open("s0")
    assert source.wait_started(3)[2] == "n0"
    source.open(*loras)
    done = {}
    for _ in range(2000):
        for req in engine.step_requests():
            if req.finished:
                done[req.request_id] = req
        if not engine.has_unfinished_requests():
            break
    assert len(done) == 7 and all(r.error is None for r in done.values())


def test_a_failing_load_fails_only_its_own_requests(tiny_model_dir, source):
    from loramux.engine import SamplingParams
    from loramux.engine.errors import LoRAError

    engine = _engine(tiny_model_dir, source, lora_load_workers=2)
    source.fail.add("bad")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    loras = _requests(["bad", "s0", "s1"])
    for name, lora in loras.items():
        for j in range(2):
            engine.add_request(f"{name}-{j}", "Hello there", params, lora)
    engine.step()
    source.wait_started(2)
    source.open(*loras)
    done = {}
    for _ in range(2000):
        for req in engine.step_requests():
            if req.finished or req.error is not None:
                done[req.request_id] = req
        if not engine.has_unfinished_requests():
            break
    assert set(done) == {f"{n}-{j}" for n in loras for j in range(2)}
    for rid, req in done.items():
        if rid.startswith("bad"):
            assert isinstance(req.error, LoRAError) and "disk went away" in str(req.error)
        else:
            assert req.error is None and len(req.seqs[0].output_token_ids) == 3, rid
    assert engine.lora_manager.failed().keys() == {"bad"}
