"""Every engine default is written once (engine/config.py): the offline ``LLM`` and the
service's ``Settings`` read it; the registry's rank limit is the engine's."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from loramux.adapters.spec import DEFAULT_MAX_LORA_RANK
from loramux.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputConfig,
)
from loramux.engine.llm import LLM
from loramux.platform.builders import ENGINE_OPTIONS, engine_config
from loramux.platform.settings import Settings, setting_default

PARTS = (ModelConfig, CacheConfig, SchedulerConfig, StructuredOutputConfig, ParallelConfig, LoRAConfig)
DIFFERENT_ON_PURPOSE = {"max_waiting"}  # the service bounds its queue


def _engine_defaults() -> dict:
    return {f.name: f.default for part in PARTS for f in dataclasses.fields(part)}


def test_settings_engine_options_default_to_the_engines():
    defaults = _engine_defaults()
    assert set(ENGINE_OPTIONS) >= {"dtype", "max_num_seqs", "max_lora_rank", "fairness_policy", "enforce_eager"}
    for name in set(ENGINE_OPTIONS) - DIFFERENT_ON_PURPOSE:
        assert setting_default(name) == defaults[name], name


def test_offline_llm_defaults_are_the_engines():
    defaults = _engine_defaults()
    params = inspect.signature(LLM.__init__).parameters
    checked = [n for n in params if n in defaults]
    assert len(checked) >= 15
    for name in checked:
        assert params[name].default == defaults[name], name


def test_one_max_lora_rank():
    assert LoRAConfig.max_lora_rank == DEFAULT_MAX_LORA_RANK == setting_default("max_lora_rank")
    from loramux.registry.factory import build_registry
    from loramux.registry.service import RegistryService

    for fn in (build_registry, RegistryService.__init__):
        assert inspect.signature(fn).parameters["max_lora_rank"].default == DEFAULT_MAX_LORA_RANK


def test_from_options_builds_the_nested_config():
    config = EngineConfig.from_options(max_num_seqs=3, block_size=32, enable_lora=True, max_loras=2,
                                       grammar_cache_size=7, dtype="float32")
    assert config.scheduler.max_num_seqs == 3 and config.cache.block_size == 32
    assert config.lora.max_loras == 2 and config.structured.grammar_cache_size == 7
    assert config.model.dtype == "float32"
    assert EngineConfig.from_options(max_loras=2).lora is None
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.from_options(max_num_seq=3)
    with pytest.raises(ValueError, match="max_loras"):
        EngineConfig.from_options(enable_lora=True, max_loras=0)


def test_settings_build_the_same_engine_config():
    s = Settings(max_num_seqs=5, max_loras=3, enable_lora=True, block_size=8, max_waiting=9)
    config = engine_config(s)
    assert (config.scheduler.max_num_seqs, config.lora.max_loras, config.cache.block_size,
            config.scheduler.max_waiting) == (5, 3, 8, 9)
    assert engine_config(Settings(enable_lora=False)).lora is None
