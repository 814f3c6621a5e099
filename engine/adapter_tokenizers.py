"""The tokenizer for a request's adapter: the base's, unless the adapter ships added tokens of
its own (``loramux.adapters.added_tokens``); then a copy of the base's tokenizer with those
tokens added (special ones as special), each verified to land on the id the adapter's files
give it. Prompts, incremental detokenization and logprobs' token strings of the adapter's
requests use it (vLLM's per-LoRA tokenizer).

Bounded against a tenant uploading many adapters with long added-token lists: at most
:data:`~loramux.adapters.added_tokens.MAX_ADDED_TOKENS` tokens an adapter (refused at upload
past it), one build at a time, and an LRU of ``max_entries`` built tokenizers (each a copy of
the base's; one still held by a running request or a server handler is found again while it
lives, so an eviction never makes the engine thread build it again mid-flight); adapters
without tokens of their own cost one small entry in a second LRU.
Structured outputs (xgrammar) keep the base's token table: under a grammar an adapter's own
tokens are never produced."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loramux.adapters.added_tokens import AddedTokenSpec, own_tokens, tokenizer_with
from loramux.adapters.errors import AdapterValidationError
from loramux.engine.errors import LoRAError
from loramux.engine.lora_request import LoRARequest

__all__ = ["AdapterTokenizers", "build_tokenizer"]

logger = logging.getLogger(__name__)

MAX_BUILT = 8
"""Built tokenizers kept (each a copy of the base's: tens of MB for a 150k vocabulary)."""
MAX_PLAIN = 4096
"""Adapters remembered as using the base's tokenizer."""


def build_tokenizer(base: Any, tokens: list[AddedTokenSpec], name: str = "adapter") -> Any:
    """A copy of ``base`` with ``tokens`` added in id order; :class:`LoRAError` naming the
    token unless each lands on its id."""
    try:
        return tokenizer_with(base, tokens)
    except AdapterValidationError as e:
        raise LoRAError(f"adapter {name!r}: {e}") from None


class AdapterTokenizers:
    """``get(lora_request)``: the tokenizer for that adapter's requests (thread-safe: the
    server's worker threads and the engine thread ask it). Keyed by the adapter's identity
    (``LoRARequest.prefix_cache_id``: name — the platform puts tenant, version and digest in
    it — id and folder)."""

    def __init__(self, base: Any, adapter_source: Callable[[str], str | Path] | None = None,
                 vocab_size: int | None = None, max_entries: int = MAX_BUILT) -> None:
        self.base = base
        self.source = adapter_source
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._built: OrderedDict[str, Any] = OrderedDict()
        self._live: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._plain: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._base_ids: dict[str, int] | None = None

    def get(self, request: LoRARequest | None) -> Any:
        """The tokenizer for ``request``'s adapter (the base's for None); :class:`LoRAError`
        when the adapter's added tokens do not fit the base's tokenizer."""
        if request is None:
            return self.base
        key = request.prefix_cache_id
        found = self._cached(key)
        if found is not None:
            return found
        with self._build_lock:  # one build at a time; another thread may have built it
            found = self._cached(key)
            if found is not None:
                return found
            return self._build(request, key)

    def peek(self, request: LoRARequest | None) -> Any:
        """The tokenizer for ``request``'s adapter when nothing needs to be read or built for
        it (call :meth:`get` off the event loop otherwise); else None."""
        return self.base if request is None else self._cached(request.prefix_cache_id)

    def _cached(self, key: str) -> Any:
        with self._lock:
            if key in self._plain:
                self._plain.move_to_end(key)
                return self.base
            tok = self._built.get(key)
            if tok is not None:
                self._built.move_to_end(key)
            return tok if tok is not None else self._live.get(key)

    def _folder(self, request: LoRARequest) -> Path | None:
        if request.lora_path is not None:
            return Path(request.lora_path)
        return Path(self.source(request.lora_name)) if self.source is not None else None

    def _build(self, request: LoRARequest, key: str) -> Any:
        folder = self._folder(request)
        if folder is None or not folder.is_dir():
            return self.base  # the adapter's registration names what is wrong
        if self._base_ids is None:
            self._base_ids = dict(self.base.get_vocab())
        try:
            tokens, _ = own_tokens(folder, self._base_ids, self.vocab_size)
        except AdapterValidationError as e:
            raise LoRAError(f"adapter {request.lora_name!r}: {e}") from None
        tok = build_tokenizer(self.base, tokens, request.lora_name) if tokens else self.base
        with self._lock:
            if tok is self.base:
                self._plain[key] = None
                while len(self._plain) > MAX_PLAIN:
                    self._plain.popitem(last=False)
            else:
                self._built[key] = self._live[key] = tok
                while len(self._built) > self.max_entries:
                    self._built.popitem(last=False)
        if tokens:
            logger.info("adapter %s: its tokenizer adds %d tokens (ids %d-%d)", request.lora_name,
                        len(tokens), tokens[0].id, tokens[-1].id)
        return tok

    def forget(self, request: LoRARequest) -> None:
        """Drop ``request``'s adapter's tokenizer (its folder changed or it was deleted)."""
        with self._lock:
            self._built.pop(request.prefix_cache_id, None)
            self._live.pop(request.prefix_cache_id, None)
            self._plain.pop(request.prefix_cache_id, None)
