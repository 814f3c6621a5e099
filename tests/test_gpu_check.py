"""``python -m bench.gpu_check --dry-run``: every part of the GPU check at toy sizes on the CPU
(Triton interpreted), so the script that runs on a lent GPU keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: int = 600, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["errors"] == {}
    assert set(report["part_s"]) == {"copy", "sgmv", "attention", "quant", "greedy", "engine"}
    assert report["copy"]["bytes_per_s"] > 0

    sgmv = report["sgmv"]
    assert sgmv["skipped"] == 0 and sgmv["failed"] == []
    assert {(c["dtype"], c["mode"]) for c in sgmv["cases"]} == {
        (d, m) for d in ("float32", "float16") for m in ("decode", "prefill")
    }
    for case in sgmv["cases"]:
        for op in ("shrink", "expand"):
            r = case[op]
            assert r["ok"] and r["err"] <= r["tol"], (case, op)
            assert r["s"] > 0 and r["bytes"] > 0 and r["bw_frac"] > 0
    attn = report["attention"]["cases"]
    assert {(c["dtype"], c["mode"]) for c in attn} == {
        (d, m) for d in ("float32", "float16") for m in ("decode", "chunk")
    }
    assert all(c["ok"] and c["err"] <= c["tol"] for c in attn), attn

    quant = report["quant"]
    assert quant["skipped"] == 0 and quant["failed"] == []
    assert {(c["scheme"], c["T"]) for c in quant["cases"]} == {
        (s, t) for s in ("w4a16_g128", "w8a16_channel") for t in (1, 5, 40)
    }
    assert all(c["ok"] and c["s"] > 0 and c["bw_frac"] > 0 for c in quant["cases"]), quant

    greedy = report["greedy"]
    assert greedy["ok"] and greedy["sequences"] == 3
    assert {r["adapter"] for r in greedy["rows"]} == {None, "a0", "a1"}

    for shape in ("7b", "1b"):
        rows = report["engine"][shape]["results"]
        assert sorted(int(k) for k in rows) == [0, 1, 2, 4]
        assert all(r["decode_tok_s"] > 0 and r["e2e_tok_s"] > 0 for r in rows.values())
        assert rows["0"]["slowdown_vs_base"] == 1.0

    goals = report["goals"]
    assert goals["kernels_within_tolerance"]["pass"] is True
    assert goals["kernels_within_tolerance"]["checked"] == 2 * len(sgmv["cases"]) + len(attn)
    assert goals["greedy_device_vs_torch"]["pass"] is True
    assert goals["quant_within_tolerance"]["pass"] is True
    assert goals["quant_within_tolerance"]["checked"] == len(quant["cases"])
    # speed goals are judged on a GPU only
    assert goals["sgmv_decode_bandwidth"]["pass"] is None
    assert goals["lora_overhead_7b"]["pass"] is None and goals["lora_overhead_7b"]["value"] > 0
    assert goals["quant_w4a16_decode_vs_bf16"]["pass"] is None
    assert "GOAL kernels_within_tolerance: PASS" in proc.stdout


def test_without_cuda_the_real_check_refuses_clearly():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real check would run")
    proc = _run("--parts", "copy", timeout=300)
    assert proc.returncode == 2
    assert "no CUDA device here: run with --dry-run" in proc.stderr


def test_unknown_part_is_refused():
    proc = _run("--dry-run", "--parts", "copy,warp", timeout=120)
    assert proc.returncode == 2 and "unknown parts ['warp']" in proc.stderr


def test_a_failing_case_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    import argparse

    monkeypatch.syspath_prepend(str(ROOT))
    from bench import gpu_check

    args = argparse.Namespace(dry_run=True, budget_s=None, out=tmp_path / "r.json", tensor_parallel_size=1)
    check = gpu_check.Check(args, gpu_check.DRY_PLAN)

    def case(i):
        if i == 2:
            raise RuntimeError("kernel exploded")
        return {"i": i, "ok": True}

    out = check._cases("attention", case, [(1,), (2,), (3,)])
    assert [c["i"] for c in out["cases"]] == [1, 3]
    assert len(out["failed"]) == 1 and "kernel exploded" in out["failed"][0]["error"]
    assert "1 case(s) failed" in check.report["errors"]["attention"]
    check.report["attention"] = out
    goal = gpu_check.goals(check.report)["kernels_within_tolerance"]
    assert goal["failed"] == 1 and goal["pass"] is False


def test_quant_goal_is_judged_on_every_w4a16_decode_case(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    from bench.gpu_check_quant import quant_goals

    def case(bits, T, speedup, proj="qkv"):
        return {"bits": bits, "T": T, "speedup_vs_torch": speedup, "proj": proj, "ok": True,
                "dtype": "bfloat16"}

    cases = [case(4, 1, 2.5), case(4, 16, 1.4, "down"), case(4, 1024, 0.3), case(8, 1, 0.9)]
    report = {"dry_run": False, "quant": {"cases": cases, "skipped": 0, "failed": []}}
    goal = quant_goals(report)["quant_w4a16_decode_vs_bf16"]
    assert goal["pass"] is True and goal["cases"] == 2 and goal["worst"] == "down T=16"
    assert goal["min_speedup_w8"] == 0.9  # reported, not judged
    cases[1]["speedup_vs_torch"] = 0.95
    assert quant_goals(report)["quant_w4a16_decode_vs_bf16"]["pass"] is False
    cases[0]["ok"] = False
    tolerance = quant_goals(report)["quant_within_tolerance"]
    assert tolerance["failed"] == 1 and tolerance["pass"] is False


def test_dry_run_greedy_part_under_tensor_parallelism(tmp_path):
    """``--tensor-parallel-size 2``: the device path's greedy outputs from two ranks (CPU
    workers here, started through the source-tree bootstrap the GPU machine's need), checked
    as always."""
    out = tmp_path / "gpu_check.json"
    proc = _run("--dry-run", "--parts", "greedy", "--tensor-parallel-size", "2", "--out", str(out),
                LORAMUX_SOURCE_TREE=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel_size"] == 2 and report["errors"] == {}
    assert report["greedy"]["ok"] and report["greedy"]["sequences"] == 3
