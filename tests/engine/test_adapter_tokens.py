"""An adapter's own added tokens (``engine/adapter_tokenizers.py``): a tiny random Llama whose
config's vocab_size is larger than its tokenizer (padded, as Qwen's), an adapter made by PEFT
with ``trainable_token_indices`` on the new ids and its tokenizer (``add_tokens`` /
``add_tokens(..., special_tokens=True)``) saved next to it. The adapter's requests tokenize and
detokenize with the adapter's tokenizer (as transformers loads it from the adapter's folder);
base requests in the same batch keep the base's."""

from __future__ import annotations

import gc
import json

import pytest
from support.added_tokens import PROMPT, SEP, TOOL, make_tokens_adapter
from support.lora_fixtures import peft_reference, teacher_forcing_gaps

from loramux.adapters.added_tokens import MAX_ADDED_TOKENS, check_added_tokens
from loramux.adapters.errors import AdapterValidationError
from loramux.engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from loramux.engine.adapter_tokenizers import AdapterTokenizers
from loramux.engine.detokenizer import Detokenizer
from loramux.engine.errors import LoRAError
from loramux.engine.sequence import Sequence


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir):
    """(base folder, adapter folder, the adapter's tokenizer, the base's)."""
    return make_tokens_adapter(tmp_path_factory.mktemp("added-tokens"), default_model_dir)


@pytest.fixture(scope="module")
def llm(setup):
    base, *_ = setup
    return LLM(str(base), dtype="float32", device="cpu", max_model_len=128, enable_lora=True,
               max_loras=2, max_lora_rank=8)


def test_adapter_requests_use_the_adapters_tokenizer(llm, setup):
    """In one batch: the adapter's prompt holds ``<tool>`` as one id (transformers' ids with
    the adapter's tokenizer), its output decodes the new ids to their text (special ones
    skipped unless asked); the base's prompt splits ``<tool>`` into base pieces and the same
    ids decode to nothing. Greedy output with the prompt's new id matches PEFT's."""
    base, adapter, tok, base_tok = setup
    lora = LoRARequest("tools", 1, str(adapter))
    tool, sep = tok.convert_tokens_to_ids([TOOL, SEP])
    forced = SamplingParams(temperature=0, max_tokens=3, logit_bias={tool: 100.0}, logprobs=1)
    outs = llm.generate([PROMPT, PROMPT, PROMPT], [forced, forced, SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)], lora_request=[lora, None, lora])
    assert outs[0].prompt_token_ids == tok(PROMPT).input_ids
    assert llm.get_tokenizer(lora)(PROMPT).input_ids == tok(PROMPT).input_ids
    assert llm.get_tokenizer() is llm.llm_engine.tokenizer
    assert tool in outs[0].prompt_token_ids
    assert outs[1].prompt_token_ids == base_tok(PROMPT).input_ids
    assert tool not in outs[1].prompt_token_ids
    assert outs[0].outputs[0].token_ids == [tool] * 3
    assert outs[0].outputs[0].text == TOOL * 3
    assert outs[0].outputs[0].logprobs[0][tool].decoded_token == TOOL
    assert outs[1].outputs[0].token_ids == [tool] * 3  # the base's padded id, forced
    assert outs[1].outputs[0].text == ""
    assert TOOL not in outs[1].outputs[0].text
    # PEFT with the adapter's tokenizer's ids: the served adapter embeds <tool> with its row
    out = outs[2].outputs[0].token_ids
    gaps, _ = teacher_forcing_gaps(peft_reference(base, adapter), outs[2].prompt_token_ids, out)
    assert max(gaps) < 1e-3
    assert outs[2].outputs[0].text == tok.decode(out, skip_special_tokens=True)
    # a special token: skipped by default, kept with skip_special_tokens=False
    for skip in (True, False):
        p = SamplingParams(temperature=0, max_tokens=2, logit_bias={sep: 100.0},
                           skip_special_tokens=skip)
        (o,) = llm.generate([PROMPT], p, lora_request=lora)
        assert o.outputs[0].text == ("" if skip else SEP * 2)


def test_chat_renders_with_the_adapters_tokenizer(llm, setup):
    _, adapter, tok, base_tok = setup
    lora = LoRARequest("tools", 1, str(adapter))
    conv = [{"role": "user", "content": PROMPT}]
    p = SamplingParams(temperature=0, max_tokens=1)
    mine, base = llm.chat([conv, conv], p, lora_request=[lora, None])
    want = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert mine.prompt_token_ids == tok(want, add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids(TOOL) in mine.prompt_token_ids
    assert tok.convert_tokens_to_ids(TOOL) not in base.prompt_token_ids


def test_incremental_detokenization_mixes_new_and_base_tokens(setup):
    """Per sequence: the adapter's tokenizer for its sequence, the base's for the other."""
    _, _, tok, base_tok = setup
    detok = Detokenizer(base_tok)
    text = "x <tool>naïve 中文<tool> end"
    ids = tok(text, add_special_tokens=False).input_ids
    seq = Sequence("r", 0, [1, 2], SamplingParams(), tokenizer=tok)
    plain = Sequence("b", 0, [1, 2], SamplingParams())
    assert "".join(detok.decode_token(seq, t) for t in ids) == tok.decode(ids)
    assert "".join(detok.decode_token(plain, t) for t in ids) == base_tok.decode(ids)
    assert TOOL not in base_tok.decode(ids)


def test_cache_is_bounded_and_keyed_by_identity(setup, tmp_path):
    _, adapter, tok, base_tok = setup
    cache = AdapterTokenizers(base_tok, max_entries=2)
    first = cache.get(LoRARequest("a", 1, str(adapter)))
    assert first is not base_tok and first.convert_tokens_to_ids(TOOL) == tok.convert_tokens_to_ids(TOOL)
    assert cache.get(LoRARequest("a", 1, str(adapter))) is first
    assert cache.get(None) is base_tok
    for i in range(3):
        cache.get(LoRARequest(f"b{i}", 2 + i, str(adapter)))
    assert len(cache._built) == 2
    assert cache.get(LoRARequest("a", 1, str(adapter))) is first  # evicted, still held: found
    del first
    gc.collect()
    again = cache.get(LoRARequest("a", 1, str(adapter)))  # evicted and dropped: built again
    assert again.convert_tokens_to_ids(TOOL) == tok.convert_tokens_to_ids(TOOL)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "adapter_config.json").write_text("{}")
    assert cache.get(LoRARequest("p", 9, str(plain))) is base_tok


def _folder(tmp_path, tokens, name="added_tokens.json"):
    folder = tmp_path / "f"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(json.dumps(tokens))
    return folder


def test_upload_refusals_name_the_token(setup, tmp_path):
    base, _, _, base_tok = setup
    n, vocab = len(base_tok), len(base_tok) + 64
    ok = check_added_tokens(_folder(tmp_path, {TOOL: n, SEP: n + 1}), vocab, str(base))
    assert [(t.content, t.id) for t in ok] == [(TOOL, n), (SEP, n + 1)]
    for tokens, match in [({TOOL: n + 1}, r"'<tool>' has id 49153, but .* gets id 49152"),
                          ({TOOL: n, SEP: n + 2}, r"'<\|sep\|>' has id 49154, but .* gets id 49153"),
                          ({TOOL: 7}, r"'<tool>' has id 7, another token of the base"),
                          ({"<|im_start|>": n}, r"'<\|im_start\|>' has id 49152 where the base"),
                          ({TOOL: vocab}, r"'<tool>' \(id 49216\) is beyond")]:
        with pytest.raises(AdapterValidationError, match=match) as e:
            check_added_tokens(_folder(tmp_path, tokens), vocab, str(base))
        assert e.value.field == "added_tokens.json"
    many = {f"<t{i}>": n + i for i in range(MAX_ADDED_TOKENS + 1)}
    with pytest.raises(AdapterValidationError, match="4097 added tokens .* limit of 4096"):
        check_added_tokens(_folder(tmp_path, many), n + len(many), str(base))
    long = {f"<{i:03d}" + "é" * 250 + ">": n + i for i in range(600)}
    with pytest.raises(AdapterValidationError, match="600 added tokens take .* above the limit"):
        check_added_tokens(_folder(tmp_path, long), n + len(long), str(base))
    with pytest.raises(AdapterValidationError, match="longer than 256"):
        check_added_tokens(_folder(tmp_path, {"x" * 300: n}), vocab, str(base))
    both = _folder(tmp_path, {"added_tokens_decoder": {str(n): {"content": SEP, "special": True}}},
                   "tokenizer_config.json")
    (both / "added_tokens.json").write_text(json.dumps({SEP: n + 1}))
    with pytest.raises(AdapterValidationError, match=r"'<\|sep\|>' has id 49153 here and 49152"):
        check_added_tokens(both, vocab, str(base))


def test_engine_refuses_tokens_its_base_would_place_elsewhere(setup, tmp_path):
    """An adapter folder that skipped the upload checks: refused at the request, token named."""
    _, adapter, _, base_tok = setup
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(adapter, bad)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bad / name).unlink(missing_ok=True)
    (bad / "added_tokens.json").write_text(json.dumps({TOOL: len(base_tok) + 3}))
    with pytest.raises(LoRAError, match="'<tool>' has id 49155"):
        AdapterTokenizers(base_tok).get(LoRARequest("bad", 3, str(bad)))


def test_beam_search_uses_the_adapters_tokenizer(llm, setup):
    _, adapter, tok, base_tok = setup
    lora = LoRARequest("tools", 1, str(adapter))
    mine, base = llm.beam_search([PROMPT, PROMPT], BeamSearchParams(beam_width=2, max_tokens=2),
                                 lora_request=[lora, None])
    n = len(tok(PROMPT).input_ids)
    for beam in mine.sequences:
        assert beam.tokens[:n] == tok(PROMPT).input_ids
        assert beam.text == tok.decode(beam.tokens[n:], skip_special_tokens=True)
    assert base.sequences[0].tokens[:len(base_tok(PROMPT).input_ids)] == base_tok(PROMPT).input_ids


def test_a_grammar_never_produces_the_adapters_tokens(llm, setup):
    """Structured outputs keep the base's xgrammar token table (documented): under a grammar
    the adapter's own ids are masked however strongly they are pushed."""
    from loramux.engine.structured_params import StructuredOutputsParams

    _, adapter, tok, _ = setup
    tool = tok.convert_tokens_to_ids(TOOL)
    p = SamplingParams(temperature=0, max_tokens=4, logit_bias={tool: 100.0},
                       structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    (o,) = llm.generate([PROMPT], p, lora_request=LoRARequest("tools", 1, str(adapter)))
    assert tool not in o.outputs[0].token_ids and TOOL not in o.outputs[0].text


def test_export_ships_the_adapters_tokens(setup, tmp_path):
    """The merged export's tokenizer holds the adapter's own tokens, from PEFT's files or from
    the form the registry stores (the config's ``loramux_added_tokens``, which PEFT ignores)."""
    import shutil

    from transformers import AutoTokenizer

    from loramux.adapters.added_tokens import STORED_KEY
    from loramux.adapters.merge import export_merged

    base, adapter, tok, _ = setup
    stored = tmp_path / "stored"
    stored.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapter / name, stored / name)
    config = json.loads((stored / "adapter_config.json").read_text())
    config[STORED_KEY] = [t.to_dict() for t in check_added_tokens(adapter, None, str(base))]
    (stored / "adapter_config.json").write_text(json.dumps(config))
    for i, folder in enumerate([adapter, stored]):
        out = export_merged(base, folder, tmp_path / f"merged{i}", check=True, progress=False)
        merged_tok = AutoTokenizer.from_pretrained(out)
        assert merged_tok(PROMPT).input_ids == tok(PROMPT).input_ids
        assert merged_tok.decode(tok.convert_tokens_to_ids([TOOL, SEP])) == TOOL + SEP
