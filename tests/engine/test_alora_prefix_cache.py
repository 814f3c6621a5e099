"""An activated LoRA's context before its invocation is the base model's, in the prefix cache
too: a base request, another aLoRA and the next turn of the conversation all hit those blocks
(``num_cached_tokens`` says so), every output teacher-forced against PEFT; the blocks from the
invocation on are the adapter's (keyed with its start), and KV events report the base's blocks
without an adapter. Also the block keys alone (no model)."""

from __future__ import annotations

from support.lora_fixtures import peft_reference
from test_alora_vs_peft import CTX, INV, INV2, _engine, check_outputs, llama  # noqa: F401

from loramux.engine import LoRARequest, SamplingParams
from loramux.engine.block_manager import KVCacheManager
from loramux.engine.intake import make_sequences
from loramux.engine.sampling_params import SamplingParams as Params
from loramux.engine.sequence import LORA_NEVER


class Events:
    def __init__(self) -> None:
        self.stored: list[tuple[int, str | None]] = []

    def blocks_stored(self, keys, parent, token_ids, block_size, lora_key) -> None:
        self.stored.append((len(keys), lora_key))

    def blocks_removed(self, keys) -> None:
        pass

    def all_blocks_cleared(self) -> None:
        pass


def test_base_then_alora_then_another_then_next_turn_share_blocks(llama):  # noqa: F811
    base, adapters = llama
    llm = _engine(base, max_num_batched_tokens=64)
    events = Events()
    llm.llm_engine.add_kv_listener(events)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    a = LoRARequest("alora", 1, str(adapters["alora"]))
    a2 = LoRARequest("alora2", 2, str(adapters["alora2"]))
    refs = {"base": peft_reference(base, None)}

    def run(prompt, lora, path, invocation):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, lora_request=[lora])
        check_outputs([out], [(prompt, (base, path) if path else None, invocation)], refs)
        return out

    out = run(CTX + [800, 801], None, None, None)  # 42 tokens: two full blocks keyed
    assert out.num_cached_tokens == 0
    turn1 = CTX + INV
    out = run(turn1, a, adapters["alora"], INV)  # starts at 40: blocks 0 and 1 are the base's
    assert out.num_cached_tokens == 32
    answer = list(out.outputs[0].token_ids)
    assert run(CTX[:35] + INV2, a2, adapters["alora2"], INV2).num_cached_tokens == 32
    # the next turn: the conversation so far and the invocation again; the last one counts,
    # so the first turn's adapter blocks are base positions now (PEFT's semantics): no hit there
    turn2 = turn1 + answer + [810, 811, 812, 813, 814, 815, 816] + INV + list(range(830, 846))
    out = run(turn2, a, adapters["alora"], INV)
    assert out.num_cached_tokens == 32
    # a base request over the second turn's context hits its base blocks (48 tokens: 3 blocks)
    assert run(turn2[:50] + [820], None, None, None).num_cached_tokens == 48
    # the adapter's own block (48..63, its start 55 inside): the same second turn hits it too
    assert run(turn2, a, adapters["alora"], INV).num_cached_tokens == 64
    # KV events: base blocks come without an adapter
    assert events.stored[0] == (2, None)
    assert any(key == "alora" for _, key in events.stored)
    assert all(key in (None, "alora", "alora2") for _, key in events.stored)


def _seq(ids, start, lora="a"):
    (seq,) = make_sequences("r", ids, Params(), lora, None if lora is None else "id-a", None, 1.0,
                            None, start, None)
    return seq


def test_block_keys_before_the_start_are_the_bases():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    ids = list(range(100, 118))
    base, alora = _seq(ids, 0, None), _seq(ids, 9)
    plain = _seq(ids, 0)
    kb, ka, kp = (kv._keys(s, 4) for s in (base, alora, plain))
    assert ka[:2] == kb[:2]  # blocks 0 and 1 end by position 8, before the start
    assert ka[2:] != kb[2:] and ka[2] != kp[2] and kp[0] != kb[0]
    # the start is part of the adapter's identity: another start in the same block, another key
    assert kv._keys(_seq(ids, 10), 4)[2] != ka[2]
    assert kv._keys(_seq(ids, 9), 4) == ka
    never = _seq(ids, LORA_NEVER)
    assert kv._keys(never, 4) == kb
