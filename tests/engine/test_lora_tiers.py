"""Adapter tiers and slot policy on a tiny model (fast)."""

from __future__ import annotations

import pytest
from support.lora_fixtures import (
    ALL_MODULES,
    make_peft_adapter,
    peft_reference,
    teacher_forcing_gaps,
)


@pytest.fixture(scope="module")
def eight_adapters(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("tiny-adapters")
    out = []
    for i in range(8):
        targets = ALL_MODULES if i % 2 else ["q_proj", "v_proj", "down_proj"]
        out.append(make_peft_adapter(tiny_model_dir, root / f"t{i}", r=4 + 4 * (i % 3), target_modules=targets,
                                     seed=100 + i, std=0.3))
    return out


def _llm(tiny_model_dir, **kw):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=128, enable_lora=True,
               max_lora_rank=16, **kw)


def test_rotation_through_two_slots(tiny_model_dir, eight_adapters):
    from loramux.engine import LoRARequest, SamplingParams

    llm = _llm(tiny_model_dir, max_loras=2, max_cpu_loras=3)
    prompts = [f"Prompt number {i} says" for i in range(16)]
    loras = [LoRARequest(f"t{i % 8}", i % 8 + 1, str(eight_adapters[i % 8])) for i in range(16)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), lora_request=loras)
    manager = llm.llm_engine.lora_manager
    assert len(manager.slot_of) <= 2
    assert len(manager.tiers.cpu) <= 3
    assert manager.num_evictions >= 6
    refs = {}
    for lora, out in zip(loras, outs, strict=True):
        if lora.lora_name not in refs:
            refs[lora.lora_name] = peft_reference(tiny_model_dir, lora.lora_path)
        gaps, _ = teacher_forcing_gaps(refs[lora.lora_name], out.prompt_token_ids, out.outputs[0].token_ids)
        assert max(gaps) <= 2e-3


def test_never_evicts_an_adapter_in_use(tiny_model_dir, eight_adapters):
    from loramux.engine import LoRARequest, SamplingParams

    llm = _llm(tiny_model_dir, max_loras=2, max_cpu_loras=4)
    engine = llm.llm_engine
    manager = engine.lora_manager
    lora = LoRARequest("t1", 2, str(eight_adapters[1]))
    expected = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=10), lora_request=lora)[0]
    engine.add_request("r1", "Hello", SamplingParams(temperature=0, max_tokens=10), lora)
    while not manager.slot_of.get("t1") is not None or not engine.scheduler.running:
        engine.step_requests()
    slot = manager.slot_of["t1"]
    # An operator tries to evict it mid-request: it stays until the request ends.
    assert manager.evict("t1")
    # Other adapters compete for the slots meanwhile.
    for i in (2, 3, 4):
        engine.add_request(f"o{i}", "Other", SamplingParams(temperature=0, max_tokens=3),
                           LoRARequest(f"t{i}", i + 1, str(eight_adapters[i])))
    final = None
    while engine.has_unfinished_requests():
        for req in engine.step_requests():
            if req.request_id == "r1" and req.finished:
                final = req.to_output()
        if "r1" in engine.requests:
            assert manager.slot_of.get("t1") == slot
    assert final.outputs[0].token_ids == expected.outputs[0].token_ids
    assert "t1" not in manager.slot_of


def test_pin_protects_and_warm_loads(tiny_model_dir, eight_adapters):
    from loramux.engine import LoRARequest, SamplingParams

    llm = _llm(tiny_model_dir, max_loras=2, max_cpu_loras=2)
    manager = llm.llm_engine.lora_manager
    reqs = [LoRARequest(f"t{i}", i + 1, str(eight_adapters[i])) for i in range(4)]
    for r in reqs:
        manager.register(r)
    assert not manager.warm("t0")  # the load runs in the background; warm never waits on it
    for _ in range(200):
        manager.poll(wait=0.05)
        if manager.warm("t0"):
            break
    assert "t0" in manager.slot_of
    manager.pin("t0")
    params = SamplingParams(temperature=0, max_tokens=3)
    llm.generate(["a", "b", "c"], params, lora_request=reqs[1:])
    assert "t0" in manager.slot_of
    tiers = {row["name"]: row for row in manager.residency()}
    assert tiers["t0"]["pinned"] and tiers["t0"]["tier"] == "device"
    assert {row["tier"] for row in tiers.values()} <= {"device", "cpu", "disk"}
    manager.unpin("t0")
    assert manager.evict("t0")
    assert "t0" not in manager.slot_of


def test_bad_adapter_is_refused(tiny_model_dir, tmp_path):
    from loramux.engine import LoRARequest, SamplingParams
    from loramux.engine.lora.manager import LoRAError

    llm = _llm(tiny_model_dir, max_loras=2)
    big = make_peft_adapter(tiny_model_dir, tmp_path / "big", r=32, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="max_lora_rank"):
        llm.generate(["x"], SamplingParams(max_tokens=2), lora_request=LoRARequest("big", 9, str(big)))
    with pytest.raises(LoRAError, match="not a folder"):
        llm.generate(["x"], SamplingParams(max_tokens=2), lora_request=LoRARequest("nope", 9, str(tmp_path / "missing")))


def test_lora_disabled_is_a_clear_error(tiny_model_dir, eight_adapters):
    from loramux.engine import LLM, LoRARequest, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="without LoRA"):
        llm.generate(["x"], SamplingParams(max_tokens=2), lora_request=LoRARequest("t0", 1, str(eight_adapters[0])))
    snap = llm.llm_engine.lora_manager.snapshot()
    assert not snap.lora_enabled and snap.rows == [] and snap.max_loras == 0


def test_adapter_events_and_snapshot(tiny_model_dir, eight_adapters):
    from loramux.engine import LoRARequest, SamplingParams

    llm = _llm(tiny_model_dir, max_loras=1, max_cpu_loras=4)
    manager = llm.llm_engine.lora_manager
    heard: list[tuple[str, str]] = []
    remove = manager.add_listener(lambda event, key: heard.append((event, key)))
    reqs = [LoRARequest(f"t{i}", i + 1, str(eight_adapters[i])) for i in range(2)]
    llm.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=2), lora_request=reqs)
    assert ("loaded", "t0") in heard and ("loaded", "t1") in heard
    assert ("evicted", "t0") in heard or ("evicted", "t1") in heard  # one slot, two adapters
    snap = manager.snapshot()
    assert snap.lora_enabled and snap.max_loras == 1 and snap.num_evictions >= 1
    assert {r["name"] for r in snap.rows} == {"t0", "t1"} and snap.knows("t1")
    manager.drop("t0")
    assert heard[-1] == ("dropped", "t0") and not manager.snapshot().knows("t0")
    remove()
    manager.drop("t1")
    assert ("dropped", "t1") not in heard


def test_abort_waiting_fails_queued_requests_of_an_adapter_at_once(tiny_model_dir, eight_adapters):
    import asyncio

    from loramux.engine import LoRARequest, SamplingParams
    from loramux.engine.async_engine import AdapterGoneError, AsyncEngine

    llm = _llm(tiny_model_dir, max_loras=2, max_num_seqs=1)
    t1, t2 = (LoRARequest(f"t{i}", i + 1, str(eight_adapters[i])) for i in (1, 2))
    eng = AsyncEngine(llm.llm_engine)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    # the running request is long enough (100 tokens) that the two behind it are still
    # queued when the adapter is failed: fast kernels decode 24 tokens in ~50 ms
    long_params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run(rid, lora, p=params):
        outs = [o async for o in eng.generate("Hello there", p, rid, lora)]
        return outs[-1]

    async def go():
        running = asyncio.ensure_future(run("running", t1, long_params))
        while not llm.llm_engine.scheduler.running:
            await asyncio.sleep(0.01)
        queued = asyncio.ensure_future(run("queued", t1))
        other = asyncio.ensure_future(run("other", t2))
        while len(llm.llm_engine.scheduler.waiting) < 2:  # both are queued behind max_num_seqs=1
            await asyncio.sleep(0.002)
        assert await eng.call(lambda: eng.fail_waiting("t1", "t1 was deleted")) == ["queued"]
        with pytest.raises(AdapterGoneError, match="t1 was deleted"):
            await asyncio.wait_for(queued, 1.0)
        first, second = await asyncio.gather(running, other)
        assert len(first.outputs[0].token_ids) == 100 and len(second.outputs[0].token_ids) == 24

    try:
        asyncio.run(go())
    finally:
        eng.shutdown()
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
