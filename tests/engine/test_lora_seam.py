"""The adapter manager's seam: LoRAManager and the null NoLoRA answer every call of
``AdapterManager``; the LoRA kernel is chosen once, not at every layer call (tiny model)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from support.lora_fixtures import make_peft_adapter, peft_reference, teacher_forcing_gaps

from loramux.engine.lora.interface import AdapterManager
from loramux.engine.lora.null import NoLoRA

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _members() -> tuple[set[str], set[str]]:
    """(methods and properties, plain attributes) of the seam."""
    calls = {n for n, v in vars(AdapterManager).items()
             if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return calls, set(AdapterManager.__annotations__)


def _llm(tiny_model_dir, **kw):
    from loramux.engine import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_model_len=64, **kw)


def test_both_managers_answer_the_whole_seam(tiny_model_dir):
    with_lora = _llm(tiny_model_dir, enable_lora=True, max_lora_rank=8, max_loras=2).llm_engine.lora_manager
    calls, attributes = _members()
    for manager in (with_lora, NoLoRA()):
        for name in attributes | calls:
            assert hasattr(manager, name), (type(manager).__name__, name)
        for name in calls:
            seam = getattr(AdapterManager, name)
            if isinstance(seam, property):
                continue
            want = list(inspect.signature(seam).parameters)[1:]
            assert list(inspect.signature(getattr(manager, name)).parameters) == want, name


def test_an_engine_without_lora_answers_adapter_calls_with_clear_errors(tiny_model_dir):
    from loramux.engine import LoRARequest, SamplingParams
    from loramux.engine.errors import LoRAError

    engine = _llm(tiny_model_dir).llm_engine
    manager = engine.lora_manager
    assert engine.runner.adapters.hook is None and manager.hook is None
    for action in (manager.evict, manager.pin, manager.unpin, manager.warm):
        with pytest.raises(LoRAError, match="not known to this engine"):
            action("some-adapter")
    with pytest.raises(LoRAError, match="without LoRA"):
        engine.add_request("r", "hello", SamplingParams(max_tokens=2), LoRARequest("a", 1, "/nowhere"))
    assert not manager.acquire("a", set()) and not manager.is_resident("a")
    assert not manager.is_loading("a") and not manager.is_evict_pending("a")
    assert manager.snapshot().rows == [] and manager.failed() == {} and dict(manager.slot_of) == {}
    engine.add_request("base", "hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def test_no_call_site_tests_enabled_to_avoid_a_call():
    found = {f"{path.relative_to(ENGINE)}: {line.strip()}"
             for path in ENGINE.rglob("*.py") for line in path.read_text().splitlines()
             if ".enabled" in line}
    # the one reader: LLMEngine.lora_enabled (AsyncEngine's), a fact the platform shows
    assert found <= {"engine.py: return self.lora_manager.enabled"}, found


def test_the_lora_kernel_is_chosen_once_not_at_every_layer_call(tiny_model_dir, tmp_path, monkeypatch):
    from loramux.engine import LoRARequest, SamplingParams
    from loramux.engine.lora import ops

    adapter = make_peft_adapter(tiny_model_dir, tmp_path / "a", r=4, seed=3, std=0.3)
    llm = _llm(tiny_model_dir, enable_lora=True, max_lora_rank=8, max_loras=2)
    calls = []
    real = ops.resolve_backend
    monkeypatch.setattr(ops, "resolve_backend", lambda *a, **k: calls.append(a) or real(*a, **k))
    out = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=4),
                       lora_request=LoRARequest("a", 1, str(adapter)))[0]
    assert calls == []
    gaps, _ = teacher_forcing_gaps(peft_reference(tiny_model_dir, adapter), out.prompt_token_ids,
                                   out.outputs[0].token_ids)
    assert max(gaps) <= 2e-3
