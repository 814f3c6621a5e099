"""The harness the comparisons with PEFT share: their prompts and the check of a mixed batch
(rows on several adapters and on the base model) against PEFT, token by token by teacher
forcing (see ARCHITECTURE.md, "Testing against the references")."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.greedy_reference import TIE_TOL
from support.lora_fixtures import peft_reference, teacher_forcing_gaps

PEFT_PROMPT_TEXTS = ["Write a SQL query that lists all customers.", "The history of the Roman Empire",
                     "def quicksort(arr):", "My favourite fruit is", "1, 2, 3, 4,",
                     "Explain photosynthesis:"]


def peft_prompts(tokenizer_dir, long_tail: int) -> list[list[int]]:
    """:data:`PEFT_PROMPT_TEXTS` as token ids (the tokenizer in ``tokenizer_dir``), the second
    made ``long_tail`` tokens longer (ids 200, 201, ...): a prompt of several prefill chunks."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = [tok(t).input_ids for t in PEFT_PROMPT_TEXTS]
    ids[1] = ids[1] + list(range(200, 200 + long_tail))
    return ids


def check_rows_match_peft(base: Path, adapters: list[Path], rows: list[list[int]],
                          choice: list[int | None], outs, *, refs: dict | None = None,
                          against_base: bool = True, logprob_tol: float = 1e-4) -> list[int]:
    """Assert each engine row (prompt ``rows[i]``, adapter ``adapters[choice[i]]`` or the base
    model for ``None``, output ``outs[i]`` with ``logprobs``) is PEFT's: every token within
    ``TIE_TOL`` of the reference's max logit and every returned logprob the reference's
    (``logprob_tol``, 1e-4). ``refs`` caches the PEFT models by choice across calls. With ``against_base``
    returns, per adapter row whose logprobs differ from the base model's by over 1e-2, that
    row's adapter index (the adapters change the numbers, so the check can fail)."""
    refs = {} if refs is None else refs
    moved: list[int] = []
    for prompt, c, out in zip(rows, choice, outs, strict=True):
        if c not in refs:
            refs[c] = peft_reference(base, adapters[c] if c is not None else None)
        comp = out.outputs[0]
        gaps, ref_lp = teacher_forcing_gaps(refs[c], prompt, comp.token_ids)
        assert max(gaps) <= TIE_TOL, (c, gaps)
        for j, entry in enumerate(comp.logprobs):
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(ref_lp[j, tid].item(), abs=logprob_tol, rel=logprob_tol), (c, j)
        if against_base and c is not None:
            if None not in refs:
                refs[None] = peft_reference(base, None)
            _, base_lp = teacher_forcing_gaps(refs[None], prompt, comp.token_ids)
            if (base_lp - ref_lp).abs().max() > 1e-2:
                moved.append(c)
    return moved
