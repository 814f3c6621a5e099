"""Comparing engine outputs with a Hugging Face reference model (see ARCHITECTURE.md,
"Testing against the references"): teacher forcing, near-tie aware exact matching, and
the harness the comparisons with transformers share (reference model, prompts, checks)."""

from __future__ import annotations

import pytest
import torch

TIE_TOL = 2e-3


@torch.no_grad()
def teacher_forced_logits(hf_model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The reference's fp32 logits [len(output_ids), V] predicting each output token."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=hf_model.device)
    logits = hf_model(input_ids=ids).logits[0].float().cpu()
    start = len(prompt_ids) - 1
    return logits[start : start + len(output_ids)]


@torch.no_grad()
def teacher_forced_logits_batch(
    hf_model, prompts: list[list[int]], outputs: list[list[int]]
) -> list[torch.Tensor]:
    """``teacher_forced_logits`` for many sequences in one right-padded forward pass."""
    seqs = [list(p) + list(o) for p, o in zip(prompts, outputs, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=hf_model.device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=hf_model.device)
    logits = hf_model(input_ids=ids, attention_mask=mask).logits.float().cpu()
    return [
        logits[i, len(p) - 1 : len(p) - 1 + len(o)]
        for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
    ]


def check_greedy(
    hf_model,
    prompt_ids: list[int],
    output_ids: list[int],
    *,
    reference_ids: list[int] | None = None,
    logits: torch.Tensor | None = None,
    tol: float = TIE_TOL,
) -> torch.Tensor:
    """Assert every engine token is an argmax of the reference given the same context.

    With ``reference_ids`` (the reference's own greedy output, possibly shorter) the
    two must be equal up to their first difference, and that difference must sit at
    a near tie. ``logits`` are the teacher-forced logits when already computed.
    Returns the teacher-forced logits.
    """
    assert output_ids, "the engine generated nothing"
    if logits is None:
        logits = teacher_forced_logits(hf_model, prompt_ids, output_ids)
    assert logits.shape[0] == len(output_ids)
    chosen = logits.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1)
    gap = logits.max(dim=-1).values - chosen
    bad = (gap > tol).nonzero().flatten().tolist()
    assert not bad, (
        f"engine token at output position {bad[0]} ({output_ids[bad[0]]}) is "
        f"{gap[bad[0]].item():.2e} below the reference's max (argmax "
        f"{int(logits[bad[0]].argmax())}); output {output_ids}"
    )
    if reference_ids is not None:
        for i in range(min(len(reference_ids), len(output_ids))):
            if reference_ids[i] != output_ids[i]:
                top2 = logits[i].topk(2).values
                margin = (top2[0] - top2[1]).item()
                assert margin <= tol, (
                    f"engine and reference differ at position {i} ({output_ids[i]} vs "
                    f"{reference_ids[i]}) where no tie is near (margin {margin:.2e})"
                )
                break
    return logits


LONG_PROMPT = (
    "Paged attention stores the keys and values of every sequence in fixed-size blocks, "
    "so that memory is allocated on demand and shared between sequences; the scheduler "
    "admits new requests while others decode, and preempts the newest when blocks run out."
)
CODE_PROMPT = "def fibonacci(n):\n    if n < 2:"


def reference_prompts(tokenizer_dir, code: str = CODE_PROMPT) -> list[list[int]]:
    """The four prompts of the comparisons with transformers, as token ids: a long one (~50
    tokens: longer than the tiny models' windows), a single token, a short sentence and
    ``code``; tokenized with the tokenizer in ``tokenizer_dir`` (the default model's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [
        tok(LONG_PROMPT).input_ids,
        [tok("Hello").input_ids[0]],
        tok("The capital of France").input_ids,
        tok(code).input_ids,
    ]


def hf_model(path):
    """The transformers model at ``path``, float32, eager attention, never stopping at EOS
    (as the engine with ``ignore_eos``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # match ignore_eos
    model.generation_config.pad_token_id = 0
    return model.eval()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """The reference's own greedy continuation (``generate``) of ``n`` tokens."""
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt_ids) :].tolist()


def check_greedy_outputs(ref, prompts: list[list[int]], outs, max_tokens: int, *,
                         distinct: bool = True) -> None:
    """Assert the engine's greedy ``outs`` (``RequestOutput``s with ``logprobs=1``, run to
    ``max_tokens`` with ``ignore_eos``) equal transformers' ``ref``: each completion has
    ``max_tokens`` tokens ending on ``length``, every token passes :func:`check_greedy`
    against the reference's own greedy output, each chosen token's logprob is the
    reference's (1e-4) at rank 1; with ``distinct`` the prompts' continuations are not all
    the same (a degenerate model tests nothing)."""
    for prompt, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) == max_tokens and comp.finish_reason == "length"
        logits = check_greedy(ref, prompt, comp.token_ids, reference_ids=hf_greedy(ref, prompt, max_tokens))
        ref_lp = torch.log_softmax(logits.double(), dim=-1)
        for pos, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert entry[tok].logprob == pytest.approx(ref_lp[pos, tok].item(), abs=1e-4)
            assert entry[tok].rank == 1
    if distinct:
        assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1, "a degenerate model tests nothing"
