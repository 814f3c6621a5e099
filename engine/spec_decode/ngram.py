"""Prompt lookup: draft the tokens that followed an earlier occurrence of the context's tail.

For the longest ``n`` in ``[min_n, max_n]`` whose last-``n``-token suffix occurs earlier in
the context (prompt + output so far), the ``k`` tokens after its latest such occurrence that
is followed by ``k`` tokens are the draft (when none is, the earliest occurrence's shorter
continuation). The search is one vectorized pass over the
context per call, no Python loop over tokens, and it extends at most the
:data:`MAX_CANDIDATES` latest occurrences of the last token: ``O(len(context) +
MAX_CANDIDATES * max_n)`` numpy work per row and step, whatever a prompt repeats.
"""

from __future__ import annotations

import numpy as np

MAX_CANDIDATES = 512
"""Latest earlier occurrences of the context's last token a match is searched from."""


class TokenBuffer:
    """A sequence's tokens as a growing int64 array (appended, never rebuilt per step)."""

    __slots__ = ("data", "size")

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """Catch up with ``tokens`` (a sequence's tokens only grow) and return the live view."""
        n = len(tokens)
        if n < self.size:  # defensive: rebuild
            self.size = 0
        if n > self.data.shape[0]:
            grown = np.empty(max(n, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        if n > self.size:
            self.data[self.size : n] = tokens[self.size : n]
            self.size = n
        return self.data[:n]


def propose(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for ``context`` [L] (empty when no n-gram of at least
    ``min_n`` tokens recurs)."""
    size = context.shape[0]
    if k < 1 or size < min_n + 1:
        return []
    # candidate match ends: earlier positions holding the last token
    ends = np.flatnonzero(context[:-1] == context[-1])[-MAX_CANDIDATES:]
    if ends.size == 0:
        return []
    length = np.ones(ends.shape[0], dtype=np.int64)
    alive = np.ones(ends.shape[0], dtype=bool)
    for m in range(1, min(max_n, size - 1)):
        idx = ends - m
        ok = alive & (idx >= 0)
        ok[ok] = context[idx[ok]] == context[size - 1 - m]
        alive = ok
        if not alive.any():
            break
        length += alive
    best = int(length.max())
    if best < min_n:
        return []
    longest = ends[length == best]
    whole = longest[longest <= size - 1 - k]  # followed by k tokens
    end = int(whole[-1] if whole.size else longest[0])  # else the longest continuation
    return context[end + 1 : end + 1 + k].tolist()
