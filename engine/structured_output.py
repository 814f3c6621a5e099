"""Structured outputs (vLLM's ``structured_outputs``): JSON schema, JSON object, regex,
choice, EBNF grammar or structural tag, enforced per row with xgrammar token bitmasks.

:class:`~loramux.engine.async_engine.AsyncEngine` compiles a request's grammar in a worker
thread before queueing it (:meth:`StructuredOutputManager.prepare`, with a time limit), so
the step loop never waits on a compile; the engine then takes the cached compiled grammar
when the request is added (a bad schema is a ``ValueError`` either way), masks each
constrained row's logits before sampling and advances the row's matcher with every
accepted token. A request with ``reasoning_end`` gets a
:class:`~loramux.engine.grammar_gate.GatedMatcher` per row instead: no mask until its
thought ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict

import torch

from loramux.engine.errors import GrammarError, GrammarTimeoutError
from loramux.engine.grammar_gate import GatedMatcher, constrains
from loramux.engine.structured_params import StructuredOutputsParams


class StructuredOutputManager:
    """Compiles grammars (cached, in worker threads) and applies their masks for one engine."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 128, compile_timeout: float = 10.0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.compile_timeout = compile_timeout
        self._compiler = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="loramux-grammar")

    def _xgr(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
        return xgr

    async def prepare(self, params: StructuredOutputsParams) -> None:
        """Compile ``params``' grammar into the cache in a worker thread (called by the async
        engine before it queues the request); raises ValueError when it is invalid and
        :class:`GrammarTimeoutError` past ``compile_timeout`` seconds."""
        fut = self._pool.submit(self.compiled, params)
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), self.compile_timeout)
        except TimeoutError:
            raise GrammarTimeoutError(
                f"structured_outputs: the grammar did not compile within {self.compile_timeout:g} s; "
                f"simplify the schema or pattern"
            ) from None

    def compiled(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (LRU cache, any thread); ValueError when invalid."""
        xgr_compiled = None
        key = params.cache_key()
        with self._lock:
            xgr_compiled = self._cache.get(key)
            if xgr_compiled is not None:
                self._cache.move_to_end(key)
                return xgr_compiled
        self._xgr()
        try:
            xgr_compiled = self._compile(params)
        except (RuntimeError, ValueError, TypeError) as e:
            if params.structural_tag is not None:
                raise GrammarError(f"structured_outputs.structural_tag is invalid: {_reason(e)}") from None
            raise GrammarError(f"structured_outputs: invalid constraint ({e})") from None
        with self._lock:
            self._cache[key] = xgr_compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return xgr_compiled

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one sequence (when a request is added: one per ``best_of``
        sequence), gated when ``params.reasoning_end`` is set; raises ValueError when the
        constraint is invalid."""
        compiled = self.compiled(params)
        matcher = self._xgr().GrammarMatcher(compiled)
        if params.reasoning_end is not None:
            return GatedMatcher(matcher, params.reasoning_end)
        return matcher

    def _compile(self, p: StructuredOutputsParams):
        c = self._compiler
        if p.json is not None:
            schema = p.json if isinstance(p.json, str) else json.dumps(p.json)
            return c.compile_json_schema(schema)
        if p.json_object:
            return c.compile_builtin_json_grammar()
        if p.regex is not None:
            return c.compile_regex(p.regex)
        if p.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in p.choice))
        if p.structural_tag is not None:
            return c.compile_structural_tag(p.structural_tag)
        return c.compile_grammar(p.grammar)

    def apply(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """Logits [B, V] with the rows whose matcher constrains (not None, not waiting for
        the end of a thought) masked to allowed tokens."""
        rows = [i for i, m in enumerate(matchers) if constrains(m)]
        if not rows:
            return logits
        logits = logits.clone()
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            matchers[i].fill_next_token_bitmask(mask, j)
        sub = logits[rows, : self.vocab_size].contiguous()
        xgr.apply_token_bitmask_inplace(sub, mask)
        logits[rows, : self.vocab_size] = sub
        return logits


def _reason(error: Exception) -> str:
    """xgrammar's message without its source location (``[time] file.cc:line: Check
    failed: (...) is false: <reason>``)."""
    text = str(error).strip()
    if "is false: " in text:
        return text.split("is false: ", 1)[1].strip()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
