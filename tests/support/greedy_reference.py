"""Comparing engine outputs with a Hugging Face reference model (see ARCHITECTURE.md,
"Testing against the references"): teacher forcing, near-tie aware exact matching."""

from __future__ import annotations

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
