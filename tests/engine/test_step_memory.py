"""A max_model_len-long prompt beside 63 short ones: it finishes, and the process's peak
memory grows by less than a bound derived from the step's token budget (ARCHITECTURE.md:
a step's memory is bounded by the token budget, never by sequences × longest length²)."""

from __future__ import annotations

import json
import subprocess
import sys

from support.tiny_models import make_tiny_llama

MAX_MODEL_LEN = 4096
BUDGET = 1024

SCRIPT = r"""
import json, resource, sys
from loramux.engine import LLM, SamplingParams

path, max_len, budget = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(path, dtype="float32", device="cpu", max_model_len=max_len, max_num_batched_tokens=budget,
          max_num_seqs=64, kv_cache_memory=64 << 20)
params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
llm.generate([{"prompt_token_ids": [5, 6]}] * 64, params)  # warm-up: the same shapes, short
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
prompts = [{"prompt_token_ids": [(i * 13) % 900 + 20 for i in range(max_len - 1)]}]
prompts += [{"prompt_token_ids": [7 + i, 8 + i]} for i in range(63)]
outs = llm.generate(prompts, params)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": after - before, "done": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def memory_bound(budget: int, hidden: int, intermediate: int, vocab: int, seqs: int) -> int:
    """Bytes a step may add: a few fp32 activations per batched token (hidden, q/k/v, gate/up),
    the attention tiles (PREFILL_TILE_SCORES scores with their mask, per KV group), the logits
    of one row per sequence with the sampler's copies, and 64 MiB of allocator slack."""
    from loramux.engine.model.attention import PREFILL_TILE_SCORES

    activations = 8 * budget * (4 * hidden + 2 * intermediate) * 4
    attention = 4 * PREFILL_TILE_SCORES * (4 + 1)
    logits = 6 * seqs * vocab * 4
    return activations + attention + logits + (64 << 20)


def test_long_prompt_beside_63_short_ones_stays_within_the_token_budget_bound(tmp_path, default_model_dir):
    path = make_tiny_llama(tmp_path / "m", default_model_dir, max_position_embeddings=MAX_MODEL_LEN)
    cfg = json.loads((path / "config.json").read_text())
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(MAX_MODEL_LEN), str(BUDGET)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["done"] == 64
    bound = memory_bound(BUDGET, cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], 64)
    # a padded step would hold [64, 1, L, L] masks and [64, H, L, L] scores: tens of GB here
    padded = 64 * cfg["num_attention_heads"] * MAX_MODEL_LEN**2 * 4
    assert bound < padded / 50
    assert result["growth"] < bound, (result, bound)
