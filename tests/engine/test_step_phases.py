"""The step's four phases as data: the scheduler reads sampled ids only, holds no tensor, and
alone changes a sequence's status."""

from __future__ import annotations

import ast

from support import scheduler_harness as harness
from support.import_graph import ROOT, imported_names, module_files

from loramux.engine.block_manager import KVCacheManager
from loramux.engine.config import SchedulerConfig
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence
from loramux.engine.step_budget import StepLimits
from loramux.engine.step_data import SampledOutput, SampledSeq

MODULES = module_files()


def _closure(module: str) -> set[str]:
    """Every name ``module`` needs at run time, through loramux's modules and the
    subpackages' ``__init__`` (the ``loramux.engine`` façade aside: it is the public API):
    loramux modules and the third-party names they import."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(3, len(parts))]  # parent subpackages
        if m in MODULES:
            todo += imported_names(m, MODULES[m].read_text(), MODULES, runtime_only=True)
    return seen


def test_the_walk_reaches_torch_where_the_engine_needs_it():
    names = _closure("loramux.engine.engine")
    assert "torch" in names and "loramux.engine.scheduler" in names


def test_the_scheduler_imports_no_torch():
    third_party = {m.split(".")[0] for m in _closure("loramux.engine.scheduler")
                   if not m.startswith("loramux")}
    assert "torch" not in third_party, sorted(third_party)
    assert "transformers" not in third_party


def test_only_the_scheduler_changes_a_sequences_status():
    writers = set()
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr == "status":
                    writers.add(path.name)
    assert writers == {"scheduler.py"}, writers


def test_update_from_output_reads_sampled_ids_and_finish_reasons():
    sched = harness.make_scheduler(SchedulerConfig(), KVCacheManager(16, 4), 64)
    a = Sequence("a", 0, [1, 2, 3], SamplingParams(max_tokens=8))
    b = Sequence("b", 0, [4, 5, 6, 7, 8], SamplingParams(max_tokens=8))
    for s in (a, b):
        sched.add(s)
    plan = sched.schedule()
    assert isinstance(plan.limits, StepLimits)  # the step budget's caps travel on the plan
    # the sample phase's data, written by hand: a took 42 and stopped, b took 9
    a.token_ids.append(42)
    a.finish_reason = "stop"
    b.token_ids.append(9)
    outcome = sched.update_from_output(plan, SampledOutput([SampledSeq(a.seq_id, [42], "stop"),
                                                            SampledSeq(b.seq_id, [9])]))
    assert outcome.advanced == ["a", "b"] and not outcome.failed
    assert a.is_finished and not b.is_finished and sched.running == [b]
    assert a.block_table == [] and b.num_computed_tokens == 5
    assert sched.kv.num_free_blocks == 16 - len(b.block_table)


def test_a_failed_request_keeps_its_rows_as_they_were():
    sched = harness.make_scheduler(SchedulerConfig(), KVCacheManager(16, 4), 64)
    a = Sequence("a", 0, [1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(a)
    plan = sched.schedule()
    outcome = sched.update_from_output(plan, SampledOutput(failed={"a": ValueError("bad row")}))
    assert list(outcome.failed) == ["a"] and outcome.advanced == []
    assert a.num_computed_tokens == 0 and not a.is_finished  # the engine ends it
