"""Errors that end one request inside an engine step (the engine goes on serving the rest)."""

from __future__ import annotations


class EngineStepError(RuntimeError):
    """A request failed inside an engine step (the engine goes on serving the others)."""


class AdapterNumericsError(EngineStepError):
    """A row's hidden state or logits became non-finite (NaN/Inf) under adapter ``adapter``
    (None = the base model): only that request fails, and the adapter is marked broken."""

    def __init__(self, message: str, adapter: str | None) -> None:
        super().__init__(message)
        self.adapter = adapter
