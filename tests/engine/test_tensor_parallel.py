"""Tensor parallelism on the CPU (gloo, 2-4 worker processes): every dense family's tiny
model, with GQA where the KV heads divide among the ranks and where they are replicated, in
mixed batches of base rows and LoRA adapters (split and fused projections), every token
teacher-forced against transformers + PEFT (float32); chunked prefill and prefix hits; adapter
loads and evictions while running; a worker killed mid-run fails the step's requests, the
engine restarts its workers and serves again; no process is left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest
from support.lora_fixtures import ALL_MODULES, make_peft_adapter
from support.peft_harness import check_rows_match_peft, peft_prompts
from support.tiny_models import make_tiny_llama, make_tiny_model

from loramux.engine import LLM, LoRARequest, SamplingParams
from loramux.engine.errors import EngineDeadError, ModelLoadError

pytestmark = pytest.mark.timeout(600)

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
CASES = {  # name: (family, tp, model overrides, [(rank, targets)])
    "llama-tp2": ("llama", 2, {}, [(8, ALL_MODULES), (4, ["q_proj", "v_proj"])]),
    "qwen3-tp2-tied": ("qwen3", 2, {}, [(16, ALL_MODULES)]),
    "gemma2-tp2-softcap": ("gemma2", 2, {}, [(8, ["o_proj", "down_proj"])]),
    "phi3-tp2-fused": ("phi3", 2, {}, [(8, FUSED), (4, ["qkv_proj"])]),
    "gemma3-tp4-replicated-kv": ("gemma3", 4, {}, [(8, ALL_MODULES)]),
    "qwen2-tp3-one-kv-head": ("qwen2", 3, dict(num_attention_heads=6, num_key_value_heads=1,
                                               hidden_size=96, intermediate_size=96), [(8, ALL_MODULES)]),
}


def _workers() -> list[psutil.Process]:
    me = psutil.Process()
    return [p for p in me.children(recursive=True)
            if "loramux.engine.distributed.worker" in " ".join(p.cmdline())]


def _gone(timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while _workers():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    return peft_prompts(default_model_dir, 40)


def _mixed_batch_matches_peft(llm, name, base, adapters, rows) -> tuple:
    """Rows round-robin over the adapters and the base model, 6 greedy tokens each, teacher-forced
    against PEFT; every adapter must move its rows' numbers. Returns (outputs, LoRA requests,
    sampling parameters)."""
    choice = [i % (len(adapters) + 1) for i in range(len(rows))]
    choice = [None if c == len(adapters) else c for c in choice]
    loras = [None if c is None else LoRARequest(f"{name}-{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    assert set(check_rows_match_peft(base, adapters, rows, choice, outs)) == set(range(len(adapters)))
    return outs, loras, params


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_model_and_adapters_match_peft(name, tmp_path, default_model_dir, prompts):
    family, tp, overrides, specs = CASES[name]
    base = make_tiny_model(tmp_path / name, default_model_dir, family, **overrides)
    adapters = [make_peft_adapter(base, tmp_path / f"a{i}", r=r, target_modules=t, seed=i, std=0.1)
                for i, (r, t) in enumerate(specs)]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=16, max_num_batched_tokens=48,
              tensor_parallel_size=tp)
    assert len(_workers()) == tp - 1
    outs, loras, params = _mixed_batch_matches_peft(llm, name, base, adapters, prompts)
    # the same prompts again: prefix-cache hits on every rank give the same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    llm.llm_engine.runner.shutdown()
    assert _gone()


def test_adapters_load_and_evict_across_ranks(tmp_path, default_model_dir, prompts):
    """Four adapters through one slot: each load and eviction is repeated on the workers."""
    base = make_tiny_model(tmp_path / "m", default_model_dir, "qwen3")
    adapters = [make_peft_adapter(base, tmp_path / f"a{i}", r=8, target_modules=ALL_MODULES, seed=i,
                                  std=0.1) for i in range(4)]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=1, max_cpu_loras=4, max_lora_rank=8, tensor_parallel_size=2)
    rows = prompts[:8]
    choice = [i % 4 for i in range(len(rows))]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    outs = [llm.generate({"prompt_token_ids": p}, params,
                         lora_request=LoRARequest(f"a{c}", c + 1, str(adapters[c])))[0]
            for p, c in zip(rows, choice, strict=True)]
    assert llm.llm_engine.lora_manager.max_loras == 1  # so each adapter replaced the last
    check_rows_match_peft(base, adapters, rows, choice, outs, against_base=False)
    llm.llm_engine.runner.shutdown()


def test_a_killed_worker_fails_the_step_and_the_workers_restart(tmp_path, default_model_dir):
    base = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    engine = llm.llm_engine
    (worker,) = _workers()
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, params)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="tensor-parallel"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - started < 30  # never a hang
    engine.reset()  # what the async engine's loop does after a death
    (fresh,) = _workers()
    assert fresh.pid != worker.pid
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids == want
    engine.runner.shutdown()
    assert _gone()


def test_workers_exit_when_the_engine_process_is_killed(tmp_path, default_model_dir):
    import subprocess
    import sys

    base = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    code = ("import sys, time; from loramux.engine import LLM; "
            f"llm = LLM({str(base)!r}, dtype='float32', device='cpu', max_model_len=64, "
            "tensor_parallel_size=2); print('up', flush=True); time.sleep(600)")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "up"
        workers = [p for p in psutil.Process(driver.pid).children(recursive=True)
                   if "loramux.engine.distributed.worker" in " ".join(p.cmdline())]
        assert len(workers) == 1
        driver.kill()
        driver.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=15)
        assert not alive
    finally:
        driver.kill()


def test_a_model_that_does_not_split_is_refused(tmp_path, default_model_dir):
    base = make_tiny_model(tmp_path / "m", default_model_dir, "llama")  # 4 heads, 2 KV heads
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 cannot split"):
        LLM(str(base), dtype="float32", device="cpu", max_model_len=64, tensor_parallel_size=3)
    assert _gone()


def test_a_launcher_started_rank_joins_through_the_env_rendezvous(tmp_path, default_model_dir,
                                                                    monkeypatch):
    """torchrun's way (also across nodes): each rank is its own process with RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; rank 1 is ``loramux serve`` (it becomes a worker), rank 0 the
    engine, which starts no worker of its own."""
    import subprocess
    import sys

    from loramux.engine.distributed.group import free_port

    base = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = LLM(str(base), dtype="float32", device="cpu", max_model_len=64).generate(
        {"prompt_token_ids": [3, 4, 5]}, params)[0].outputs[0].token_ids
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    loramux = str(Path(sys.executable).with_name("loramux"))
    rank1 = subprocess.Popen([loramux, "serve", "--model", str(base),
                              "--dtype", "float32", "--device", "cpu", "--tensor-parallel-size", "2"],
                             env=dict(env, RANK="1"))
    try:
        for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
            monkeypatch.setenv(k, env[k])
        monkeypatch.setenv("RANK", "0")
        llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, tensor_parallel_size=2)
        assert not _workers()  # the launcher's rank, not ours
        assert llm.generate({"prompt_token_ids": [3, 4, 5]}, params)[0].outputs[0].token_ids == want
        llm.llm_engine.runner.shutdown()
        assert rank1.wait(30) == 0  # it left when rank 0 said stop
    finally:
        rank1.kill()


def test_the_async_engine_restarts_its_workers_after_a_death(tmp_path, default_model_dir):
    """The server's engine loop: a killed worker fails the request in flight with
    EngineDeadError (never a hang), the loop restarts with new workers, /ready turns true
    again and the same prompt gives the same tokens."""
    import asyncio

    from loramux.engine.async_engine import AsyncEngine
    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine

    base = make_tiny_model(tmp_path / "m", default_model_dir, "llama")
    config = EngineConfig.from_options(model=str(base), dtype="float32", device="cpu",
                                       max_model_len=64, tensor_parallel_size=2)
    engine = AsyncEngine(LLMEngine(config))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def run() -> list[int]:
        last = None
        async for out in engine.generate({"prompt_token_ids": [3, 4, 5]}, params):
            last = out
        return last.outputs[0].token_ids

    try:
        want = asyncio.run(run())
        (worker,) = _workers()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            asyncio.run(run())
        assert time.monotonic() - started < 30
        deadline = time.monotonic() + 60
        while not engine.is_ready:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert engine.restarts == 1 and len(_workers()) == 1
        assert asyncio.run(run()) == want
    finally:
        engine.shutdown()
        engine.engine.runner.shutdown()
    assert _gone()


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MOE = {  # name: (family, overrides, [(rank, target_modules, target_parameters)])
    "qwen3_moe": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), [
        (8, ["q_proj", "v_proj"], EXPERTS), (4, ["o_proj"], ["mlp.experts.down_proj"]),
        (8, "all-linear", None)]),  # attention, the dense layer's MLP, the experts and the router
    "mixtral": ("mixtral", {}, [(8, ["q_proj"], EXPERTS), (8, ["v_proj"], ["mlp.gate.weight"])]),
}


@pytest.mark.parametrize("name", list(MOE))
def test_sharded_experts_and_expert_adapters_match_peft(name, tmp_path, default_model_dir, prompts):
    """MoE bases: each rank holds every expert with its share of the intermediate size (the
    router whole); expert LoRA sliced the same way."""
    family, overrides, specs = MOE[name]
    base = make_tiny_model(tmp_path / name, default_model_dir, family, **overrides)
    adapters = [make_peft_adapter(base, tmp_path / f"a{i}", r=r, target_modules=m, seed=i + 2, std=0.3,
                                  **({"target_parameters": p} if p else {}))
                for i, (r, m, p) in enumerate(specs)]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=16, max_num_batched_tokens=40,
              tensor_parallel_size=2)
    _mixed_batch_matches_peft(llm, name, base, adapters, prompts[:12])
    llm.llm_engine.runner.shutdown()


DORA = {  # name: (family, tp, [(kind, rank, targets)])
    "qwen2-tp2-biases": ("qwen2", 2, [("dora", 8, ALL_MODULES), ("lora", 8, ["v_proj", "up_proj", "down_proj"]),
                                      ("dora", 4, ["k_proj", "o_proj"])]),
    "phi3-tp2-fused": ("phi3", 2, [("dora", 8, FUSED), ("dora", 4, ["qkv_proj"])]),
    "gemma3-tp4-replicated-kv": ("gemma3", 4, [("dora", 8, ALL_MODULES)]),
}


@pytest.mark.parametrize("name", list(DORA))
def test_dora_adapters_match_peft_under_tensor_parallelism(name, tmp_path, default_model_dir, prompts):
    """DoRA's per-row norms ‖W0 + s·BA‖ from the whole rows: each rank's rows of q, k, v, gate, up
    (KV heads replicated on several ranks), the ranks' partial sums over o's and down's input
    columns added up at load; the row-parallel bias correction added once. DoRA, plain LoRA and
    base rows in one batch, teacher-forced against PEFT."""
    from support.lora_fixtures import make_dora_adapter

    family, tp, specs = DORA[name]
    base = (make_tiny_llama(tmp_path / name, default_model_dir, architecture="qwen2") if family == "qwen2"
            else make_tiny_model(tmp_path / name, default_model_dir, family))
    adapters = [(make_dora_adapter if kind == "dora" else make_peft_adapter)(
        base, tmp_path / f"a{i}", r=r, target_modules=t, seed=i, std=0.2) for i, (kind, r, t) in enumerate(specs)]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=8, max_num_batched_tokens=48, tensor_parallel_size=tp)
    _mixed_batch_matches_peft(llm, name, base, adapters, prompts[:8])
    llm.llm_engine.runner.shutdown()


def test_a_dora_adapter_cancelling_a_row_parallel_row_is_refused_and_the_neighbour_is_served(
        tmp_path, default_model_dir):
    """o_proj's rows are split over the ranks' input columns: only the joined norm shows the
    cancellation (each rank's partial norm alone does not), so the refusal proves the sum."""
    from safetensors.torch import load_file, save_file
    from support.lora_fixtures import make_dora_adapter

    from loramux.engine.errors import LoRAError

    base = make_tiny_llama(tmp_path / "m", default_model_dir)
    dora = make_dora_adapter(base, tmp_path / "dora", r=4, target_modules=["o_proj"], std=0.1)
    w0 = load_file(base / "model.safetensors")["model.layers.0.self_attn.o_proj.weight"]
    path = dora / "adapter_model.safetensors"
    tensors = load_file(path)
    key = "base_model.model.model.layers.0.self_attn.o_proj.lora_"
    tensors[key + "A.weight"][0] = w0[0]
    tensors[key + "B.weight"][0] = 0.0
    tensors[key + "B.weight"][0, 0] = -1.0 / 2  # s = 2: s·(BA)[0] = -W0[0], over every rank's columns
    tensors[key + "magnitude_vector"][0] = 100.0
    save_file(tensors, path)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=64, enable_lora=True, max_loras=1,
              max_lora_rank=4, tensor_parallel_size=2)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with pytest.raises(LoRAError, match=r"layer 0 o_proj scales its rows by up to .*nearly cancel"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params, lora_request=LoRARequest("d", 1, str(dora)))
    assert len(llm.generate({"prompt_token_ids": [1, 2, 3]}, params)[0].outputs[0].token_ids) == 3
    llm.llm_engine.runner.shutdown()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_vocabulary_parallel_with_trainable_tokens_and_embedding_lora_match_peft(tied, tmp_path,
                                                                                default_model_dir, prompts):
    """Each rank holds its share of the embedding and lm_head rows (tied or not); the
    adapters' trainable tokens and embed_tokens / lm_head LoRA still apply on every rank's
    embedding output and on rank 0's gathered logits."""
    from support.tiny_models import make_tiny_llama

    base = make_tiny_llama(tmp_path / "base", default_model_dir, tie_word_embeddings=tied)
    rows = (prompts + prompts)[:8]
    ids = sorted({rows[0][1], rows[2][0], rows[3][2], 42, 40000})  # both ranks' halves of the vocabulary
    specs = [dict(target_modules=["q_proj"], trainable_token_indices=ids),
             dict(target_modules=["embed_tokens", "lm_head"]),
             dict(target_modules=["embed_tokens", "o_proj"], ensure_weight_tying=True)]
    adapters = [make_peft_adapter(base, tmp_path / f"v{i}", r=8, seed=i, std=0.1, **extra)
                for i, extra in enumerate(specs)]
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
              max_loras=len(adapters), max_lora_rank=8, tensor_parallel_size=2)
    choice = [0, 1, 2, None, 0, 1, 2, None]
    loras = [None if c is None else LoRARequest(f"v{c}", c + 1, str(adapters[c])) for c in choice]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in rows], params, lora_request=loras)
    check_rows_match_peft(base, adapters, rows, choice, outs, against_base=False)
    llm.llm_engine.runner.shutdown()


def test_speculative_decoding_structured_output_beams_and_seeds_as_in_one_process(tmp_path, default_model_dir):
    """What runs on rank 0 alone (drafts and their verify rows, grammars, beams, seeded
    sampling, prompt logprobs) gives under TP 2 what one process gives."""
    from loramux.engine import BeamSearchParams

    base = make_tiny_model(tmp_path / "m", default_model_dir, "qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]}
    asks = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2),
            SamplingParams(temperature=0.9, seed=7, max_tokens=10, ignore_eos=True, n=2),
            SamplingParams(temperature=0, max_tokens=6, structured_outputs={"regex": "[a-z]{2,5}"})]

    def run(tp: int):
        llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=128, speculative_config=spec,
                  tensor_parallel_size=tp)
        outs = [[(c.token_ids, c.text) for c in o.outputs] for o in llm.generate([prompt] * 3, asks)]
        outs.append([round(lp.logprob, 4) for pos in llm.generate(prompt, asks[0])[0].prompt_logprobs[1:]
                     for lp in pos.values()])
        beams = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
        outs.append([b.tokens for b in beams[0].sequences])
        if tp > 1:
            llm.llm_engine.runner.shutdown()
        return outs

    assert run(2) == run(1)


SLOW_WORKER_PARTS = """
import os, time
import loramux.engine.lora.dora as dora

_parts = dora.BaseProjections.parts


def _slow(self, weights):
    time.sleep(float(os.environ["LORAMUX_TEST_DORA_PARTS_DELAY"]))
    return _parts(self, weights)


dora.BaseProjections.parts = _slow
"""


def _slow_dora_workers(tmp_path, default_model_dir, monkeypatch, delay: float):
    """A TP 2 engine whose worker takes ``delay`` s more to compute its DoRA parts (a
    ``sitecustomize`` only the worker processes import), and a DoRA adapter for it."""
    from support.lora_fixtures import make_dora_adapter

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_WORKER_PARTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("LORAMUX_TEST_DORA_PARTS_DELAY", str(delay))
    base = make_tiny_llama(tmp_path / "m", default_model_dir)
    dora = make_dora_adapter(base, tmp_path / "dora", r=4, target_modules=["q_proj", "o_proj"], std=0.1)
    llm = LLM(str(base), dtype="float32", device="cpu", max_model_len=512, enable_lora=True, max_loras=1,
              max_lora_rank=4, tensor_parallel_size=2)
    return llm, dora


def test_a_dora_load_does_not_hold_a_neighbours_steps_while_the_workers_compute(tmp_path, default_model_dir,
                                                                               monkeypatch):
    """A tenant's DoRA adapter makes every rank compute its parts of the row norms (a projection
    per module; over a quantized base, dequantized bands). The workers (made 1.5 s slow here by
    a ``sitecustomize`` only their processes import) compute beside their steps: the
    neighbour's stream keeps its pace and its tokens while the adapter loads."""
    delay = 1.5
    llm, dora = _slow_dora_workers(tmp_path, default_model_dir, monkeypatch, delay)
    engine = llm.llm_engine
    neighbour = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, neighbour)[0].outputs[0].token_ids
    engine.add_request("n", {"prompt_token_ids": [5, 6, 7]}, neighbour)
    for _ in range(3):
        engine.step()
    added = time.monotonic()
    engine.add_request("d", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=2),
                       lora_request=LoRARequest("d", 1, str(dora)))
    step_ends, first_dora, outputs = [], None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
            if out.request_id == "d" and first_dora is None and out.outputs[0].token_ids:
                first_dora = time.monotonic()
        if first_dora is None:
            step_ends.append(time.monotonic())
    llm.llm_engine.runner.shutdown()
    assert first_dora is not None and first_dora - added >= delay  # the workers' parts were slow
    gaps = [b - a for a, b in zip([added, *step_ends], step_ends, strict=False)]
    assert len(gaps) > 10 and max(gaps) < delay / 2  # no step waited for them
    assert outputs["n"].outputs[0].token_ids == alone and len(outputs["d"].outputs[0].token_ids) == 2


def test_a_stalled_workers_dora_norms_fail_that_adapter_after_the_timeout_and_nothing_else(
        tmp_path, default_model_dir, monkeypatch):
    """A worker that does not finish its DoRA parts within ``tensor_parallel_timeout``: the
    adapter is refused naming the timeout (the workers drop the exchange), the engine keeps
    serving the base and plain adapters, and the group is unharmed."""
    from loramux.engine.errors import LoRAError

    llm, dora = _slow_dora_workers(tmp_path, default_model_dir, monkeypatch, delay=6.0)
    llm.llm_engine.runner.workers.timeout = 2.0  # the DoRA wait's deadline (read per exchange)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids
    started = time.monotonic()
    with pytest.raises(LoRAError, match=r"did not compute a DoRA adapter's norms within tensor_parallel_timeout"):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params, lora_request=LoRARequest("d", 1, str(dora)))
    assert time.monotonic() - started < 5.0  # the deadline, not the worker's 6 s
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids == alone
    time.sleep(4.5)  # the dropped computation ends on the worker; its result goes nowhere
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids == alone
    llm.llm_engine.runner.shutdown()
