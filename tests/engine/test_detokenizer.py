"""Incremental detokenization and stop strings, with the default model's tokenizer."""

from __future__ import annotations

import pytest

from loramux.engine.detokenizer import Detokenizer, stream_holdback
from loramux.engine.postprocess import Postprocessor
from loramux.engine.request import Request
from loramux.engine.sampler import SamplerOutput
from loramux.engine.sampling_params import SamplingParams
from loramux.engine.sequence import Sequence

TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji test 😀👍🏽 and 🇫🇷 flags",
    "naïve café — “quotes” ∑∫ end",
    "Mixed 中文 and English 🙂 with spaces   and\nnew lines\t\ttabs.",
    " leading space and trailing space ",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def detok(tokenizer):
    return Detokenizer(tokenizer)


def new_seq(**params) -> Sequence:
    return Sequence("r", 0, [1, 2, 3], SamplingParams(**params))


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoding_equals_full_decode(tokenizer, detok, text):
    ids = ids_of(tokenizer, text)
    assert len(ids) > 5
    seq = new_seq()
    pieces = [detok.decode_token(seq, t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    # never a replacement character for a half-received multi-byte character
    assert all("\ufffd" not in p for p in pieces)
    if any("\ufffd" in tokenizer.decode([t]) for t in ids):  # a token ends inside a character
        assert "" in pieces


def test_sequences_decode_independently(tokenizer, detok):
    a_ids, b_ids = ids_of(tokenizer, TEXTS[0]), ids_of(tokenizer, TEXTS[1])
    a, b = new_seq(), new_seq()
    out_a, out_b = [], []
    for i in range(max(len(a_ids), len(b_ids))):  # interleaved, as in a batch
        if i < len(a_ids):
            out_a.append(detok.decode_token(a, a_ids[i]))
        if i < len(b_ids):
            out_b.append(detok.decode_token(b, b_ids[i]))
    assert "".join(out_a) == TEXTS[0] and "".join(out_b) == TEXTS[1]


def test_special_tokens_skipped_or_kept(tokenizer, detok):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = ids_of(tokenizer, "Hi there") + [im_end] + ids_of(tokenizer, " again")
    skip = new_seq()
    assert "".join(detok.decode_token(skip, t) for t in ids) == "Hi there again"
    keep = new_seq(skip_special_tokens=False)
    assert "".join(detok.decode_token(keep, t) for t in ids) == "Hi there<|im_end|> again"


def metaspace_tokenizer():
    """A SentencePiece-style (Llama-2 / Mistral) tokenizer: '▁' marks a leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁Hello": 3, "▁world": 4, "▁the": 5, "▁end": 6, "!": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_first_output_token_keeps_its_leading_space_with_sentencepiece_tokenizers():
    tokenizer = metaspace_tokenizer()
    detok = Detokenizer(tokenizer)
    prompt, out = [1, 3, 4], [5, 6, 7]  # "<s> Hello world" -> " the end!"
    seq = Sequence("r", 0, prompt, SamplingParams())
    text = "".join(detok.decode_token(seq, t) for t in out)
    full = tokenizer.decode(prompt + out, skip_special_tokens=True)
    assert full == "Hello world the end!"
    # the text the output adds to the prompt, as vLLM reports it
    assert text == full[len(tokenizer.decode(prompt, skip_special_tokens=True)) :] == " the end!"


# ------------------------------------------------------------------------ stop strings


def feed(tokenizer, detok, text: str, *, stream: bool = False, **params):
    """Push ``text`` token by token through the postprocessor, as the engine does.

    Returns (sequence, consumed token count, streamed snapshots).
    """
    post = Postprocessor(detok, {tokenizer.eos_token_id}, max_model_len=10_000)
    params.setdefault("max_tokens", 1000)
    seq = new_seq(**params)
    req = Request("r", None, seq.prompt_token_ids, seq.params, [seq])
    ids = ids_of(tokenizer, text)
    snapshots = []
    consumed = 0
    for t in ids:
        post.accept(seq, 0, SamplerOutput([t], None, None, None, None))
        consumed += 1
        if stream:
            snapshots.append(req.to_output(streaming=True).outputs[0].text)
        if seq.is_stopped:
            break
    return seq, consumed, snapshots


TEXT = "Hello world, this is the endless end of it."
# tokens: Hello| world|,| this| is| the| endless| end| of| it|.


def test_stop_string_spanning_token_boundaries_is_cut(tokenizer, detok):
    seq, consumed, _ = feed(tokenizer, detok, TEXT, stop=["e end"])  # "th|e| end|less"
    assert seq.text == "Hello world, this is th"
    assert seq.finish_reason == "stop" and seq.stop_reason == "e end"
    assert consumed == 7  # stopped at " endless", the token that completed the match


def test_stop_string_kept_with_include_stop_str_in_output(tokenizer, detok):
    seq, consumed, _ = feed(tokenizer, detok, TEXT, stop="e end", include_stop_str_in_output=True)
    assert seq.text == "Hello world, this is the end"  # text after the stop string is dropped
    assert seq.stop_reason == "e end" and consumed == 7


def test_earliest_stop_string_wins(tokenizer, detok):
    seq, _, _ = feed(tokenizer, detok, TEXT, stop=["of it", "is the", "world"])
    assert seq.text == "Hello "
    assert seq.stop_reason == "world"
    seq, consumed, _ = feed(tokenizer, detok, TEXT, stop=["end of", "less end"])
    # both complete with the token " end": the one that starts earlier wins
    assert seq.text == "Hello world, this is the end"
    assert seq.stop_reason == "less end" and consumed == 8


def test_stop_string_across_multibyte_characters(tokenizer, detok):
    text = "今天天气很好。明天也好。"
    seq, _, _ = feed(tokenizer, detok, text, stop="天气很")
    assert seq.text == "今天" and seq.stop_reason == "天气很"


def test_no_stop_string_match_runs_to_the_end(tokenizer, detok):
    seq, consumed, _ = feed(tokenizer, detok, TEXT, stop=["xyz", "end  of"])
    assert seq.text == TEXT and not seq.is_stopped
    assert consumed == len(ids_of(tokenizer, TEXT))


def test_min_tokens_defers_stop_strings(tokenizer, detok):
    seq, consumed, _ = feed(tokenizer, detok, TEXT, stop="world", min_tokens=3)
    # "world" completes with token 2 < min_tokens: ignored, later text is kept
    assert not seq.is_stopped and seq.text == TEXT


def test_streaming_never_shows_text_that_is_later_cut(tokenizer, detok):
    seq, _, snapshots = feed(tokenizer, detok, TEXT, stream=True, stop=["e end"])
    final = seq.text
    assert final == "Hello world, this is th"
    for snap in snapshots:
        assert final.startswith(snap), (snap, final)
        assert "e en" not in snap
    # while running, the last len(stop) - 1 characters are held back
    assert snapshots[5] == "Hello world, this is the"[: -(len("e end") - 1)]
    assert snapshots[-1] == final  # finished: nothing held back


def test_holdback_only_when_needed(tokenizer, detok):
    seq, _, snapshots = feed(tokenizer, detok, TEXT, stream=True)
    assert snapshots[-1] == TEXT  # no stop strings: nothing held back
    assert stream_holdback(new_seq(stop=["abc", "z"])) == 2
    assert stream_holdback(new_seq(stop="abc", include_stop_str_in_output=True)) == 0
    assert stream_holdback(new_seq()) == 0
