"""Speculative decoding (vLLM's ``--speculative-config``): ngram / prompt-lookup drafts from
a sequence's own prompt and output, verified in the next step's forward pass.

- :mod:`.config` — :class:`SpeculativeConfig`, parsed and validated from vLLM's JSON.
- :mod:`.ngram` — the proposer: the tokens that followed the latest earlier occurrence of
  the sequence's last n tokens (``prompt_lookup_min <= n <= prompt_lookup_max``).
- :mod:`.drafter` — per-sequence drafting state, the budget caps and the switch that turns
  drafting off for a sequence whose acceptance stays low; per-adapter counters.
- :mod:`.verify` — acceptance: each drafted position is sampled with the row's own
  parameters exactly as a normal decode would, and the draft is kept while it matches.

The scheduler asks the :class:`~.drafter.Drafter` for a decode row's drafts (the row then
computes ``1 + k`` tokens through the same paged attention, LoRA kernels and KV writes as
a prompt chunk); after the step :func:`~.verify.verify_drafts` accepts a prefix of them and
the KV blocks that only rejected tokens used go back to the pool.
"""

from loramux.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
