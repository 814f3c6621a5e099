"""Every exception the engine raises to its callers, in one place.

Each is an :class:`EngineError` and also the built-in class callers have always caught
(``ValueError`` for bad input, ``RuntimeError`` for a state of the engine, ``LookupError``
for something gone). The HTTP layer maps each class to its answer in one table
(``loramux.platform.errors``); a new exception here needs a row there (a test checks).
Nothing here imports anything: any module of the engine may raise these.
"""

from __future__ import annotations


class EngineError(Exception):
    """The base of the engine's exceptions."""


# --- a request refused before it runs ---------------------------------------------------
class PromptError(EngineError, ValueError):
    """The prompt itself cannot run: empty, token ids outside the vocabulary, or not a
    prompt at all. ``param`` is the request field (``prompt``)."""

    param = "prompt"


class ContextLengthError(EngineError, ValueError):
    """Prompt + output do not fit in ``max_model_len``; ``param`` says what to shorten
    (``prompt`` or ``max_tokens``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingParamError(EngineError, ValueError):
    """A sampling parameter is invalid; ``param`` names it (the HTTP error's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarError(EngineError, ValueError):
    """A structured-output constraint (JSON schema, regex, choices, grammar) is invalid."""


class GrammarTimeoutError(GrammarError):
    """A grammar took longer than ``grammar_compile_timeout`` to compile."""


class QueueFullError(EngineError, RuntimeError):
    """The waiting queue is at ``max_waiting``; retry later."""


# --- adapters ---------------------------------------------------------------------------
class LoRAError(EngineError, ValueError):
    """An adapter cannot be served (unknown, invalid, or incompatible with the base model)."""


class AdapterBrokenError(LoRAError):
    """The adapter was marked broken (its outputs became non-finite while serving); it is
    refused until it is replaced (another path or id under its name)."""


class AdapterGoneError(EngineError, LookupError):
    """A queued request's adapter was deleted or replaced before the request started."""


# --- a request failed while it ran --------------------------------------------------------
class EngineStepError(EngineError, RuntimeError):
    """A request failed inside an engine step (the engine goes on serving the others)."""


class AdapterNumericsError(EngineStepError):
    """A row's hidden state or logits became non-finite (NaN/Inf) under adapter ``adapter``
    (None = the base model): only that request fails, and the adapter is marked broken."""

    def __init__(self, message: str, adapter: str | None) -> None:
        super().__init__(message)
        self.adapter = adapter


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop stopped (an error, or shutdown): the call did not run. The loop
    restarts in-process after an error; the HTTP layer answers 503."""


class CollectiveError(EngineError, RuntimeError):
    """Tensor parallelism: an all-reduce could not complete (a rank exited or stalled past
    the timeout); the step fails and the engine replaces its workers (HTTP 503)."""


class OutOfBlocksError(EngineError, RuntimeError):
    """The KV block pool has fewer free blocks than asked for (the scheduler checks first:
    reaching a caller means a bookkeeping bug)."""


# --- the engine cannot start --------------------------------------------------------------
class ModelLoadError(EngineError, ValueError):
    """The folder is not a loadable model of a supported architecture (``adapters.arch``)."""


class DefaultModelError(EngineError, RuntimeError):
    """The default model cannot be found or converted."""
