"""``--speculative-config``: validated at start, handed to the engine, and its per-adapter
acceptance counters exported on /metrics."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loramux.engine.outputs import EngineStats
from loramux.engine.spec_decode.drafter import SpecCounts
from loramux.platform.builders import engine_config
from loramux.platform.cli.flags import add_settings_arguments, settings_from_args
from loramux.platform.metrics import Metrics
from loramux.platform.settings import Settings


def test_the_flag_reaches_the_engine_config_and_bad_ones_stop_the_start():
    cfg = engine_config(Settings(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, '
                                                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'))
    spec = cfg.speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (3, 4, 2)
    assert engine_config(Settings()).speculative is None
    with pytest.raises(ValidationError, match="unknown keys"):
        Settings(speculative_config='{"num_speculative_tokens": 2, "model": "x"}')
    with pytest.raises(ValidationError, match="method"):
        Settings(speculative_config='{"method": "eagle", "num_speculative_tokens": 2}')


def test_the_serve_command_has_the_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config(settings_from_args(args)).speculative.num_speculative_tokens == 5


def test_acceptance_counters_per_adapter_on_metrics():
    m = Metrics()
    stats = EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_preemptions=0,
                        spec_decode={"base": SpecCounts(4, 16, 4),
                                     "1/sql@abc": SpecCounts(10, 40, 30, [10, 9, 7, 4])})
    m.update_engine(stats, None)
    text = m.render().decode()
    assert 'loramux_spec_decode_num_draft_tokens{adapter="1/sql@abc"} 40.0' in text
    assert 'loramux_spec_decode_num_accepted_tokens{adapter="1/sql@abc"} 30.0' in text
    assert 'loramux_spec_decode_acceptance_rate{adapter="base"} 0.25' in text
    assert 'loramux_spec_decode_num_drafts{adapter="base"} 4.0' in text
    assert 'loramux_spec_decode_num_accepted_tokens_per_pos{adapter="1/sql@abc",position="2"} 7.0' in text
