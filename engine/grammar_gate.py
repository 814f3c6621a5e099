"""A row's grammar that waits for the end of a thought (vLLM's reasoning + structured outputs).

A reasoning model thinks freely and answers under the constraint: with
``StructuredOutputsParams.reasoning_end`` set, the row's ``Sequence.grammar`` is a
:class:`GatedMatcher`. Until the row's generated tokens contain one of the end sequences
(e.g. the ids of ``</think>``) it masks nothing and the wrapped matcher takes no token; from
the token after that, it is the matcher, from its grammar's start. Its state is the tokens
it was fed (the sample phase feeds every accepted token, verified drafts included), so it
lives on the sequence through preemption (recompute keeps the tokens) and each ``n`` /
``best_of`` sibling has its own. Each token costs a look at the last few tokens, never a
rescan of the output.

Pure Python (no torch, no xgrammar): the scheduler's drafter asks :func:`constrains`.
"""

from __future__ import annotations


class GatedMatcher:
    """An xgrammar matcher that starts after the thought; the matcher interface the engine
    uses (``accept_token``, ``is_terminated``, ``fill_next_token_bitmask``) plus
    :attr:`constraining`."""

    __slots__ = ("matcher", "ends", "constraining", "_tail", "_keep")

    def __init__(self, matcher, ends: list[list[int]]) -> None:
        self.matcher = matcher
        """The row's fresh xgrammar ``GrammarMatcher``."""
        self.ends = [list(e) for e in ends]
        """Token-id sequences that close the thought."""
        self.constraining = False
        """True once an end sequence was generated: the grammar masks the next token."""
        self._tail: list[int] = []  # the last len(longest end) - 1 generated tokens at most
        self._keep = max(len(e) for e in self.ends)

    def accept_token(self, token_id: int) -> bool:
        """Called with each token the row takes (after it was sampled under
        :meth:`fill_next_token_bitmask`'s mask, if any): the matcher's answer once
        constraining; before, True, and the gate closes when ``token_id`` ends a thought."""
        if self.constraining:
            return self.matcher.accept_token(token_id)
        tail = self._tail
        tail.append(token_id)
        for end in self.ends:
            if len(tail) >= len(end) and tail[len(tail) - len(end):] == end:
                self.constraining = True
                self._tail = []
                return True
        if len(tail) >= self._keep:
            del tail[: len(tail) - self._keep + 1]
        return True

    def is_terminated(self) -> bool:
        """The grammar reached its end (never while the thought goes on)."""
        return self.constraining and self.matcher.is_terminated()

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> bool:
        """The matcher's mask for the next token; only called while :attr:`constraining`."""
        if not self.constraining:
            raise RuntimeError("the grammar does not apply before the end of the thought")
        return self.matcher.fill_next_token_bitmask(bitmask, index)


def constrains(grammar: object | None) -> bool:
    """Whether a row's grammar (``Sequence.grammar``) masks its next token: not when it has
    none or when it waits for the end of the thought."""
    if grammar is None:
        return False
    return not isinstance(grammar, GatedMatcher) or grammar.constraining
