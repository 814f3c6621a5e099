"""Structured outputs (vLLM's ``structured_outputs``): JSON schema, JSON object, regex,
choice or EBNF grammar, enforced per row with xgrammar token bitmasks.

:class:`~loramux.engine.async_engine.AsyncEngine` compiles a request's grammar in a worker
thread before queueing it (:meth:`StructuredOutputManager.prepare`, with a time limit), so
the step loop never waits on a compile; the engine then takes the cached compiled grammar
when the request is added (a bad schema is a ``ValueError`` either way), masks each
constrained row's logits before sampling and advances the row's matcher with every
accepted token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from loramux.engine.errors import GrammarError, GrammarTimeoutError


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, dict or string), ``json_object``
    (any JSON object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (EBNF)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                f"got {given or 'none'}."
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (object or string).")

    def cache_key(self) -> str:
        return json.dumps(
            {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
             "json_object": bool(self.json_object)},
            sort_keys=True,
        )


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
            raise GrammarError(f"structured_outputs: invalid constraint ({e})") from None
        with self._lock:
            self._cache[key] = xgr_compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return xgr_compiled

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one sequence; raises ValueError when the constraint is invalid."""
        compiled = self.compiled(params)
        return self._xgr().GrammarMatcher(compiled)

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
        return c.compile_grammar(p.grammar)

    def apply(self, logits: torch.Tensor, matchers: list) -> torch.Tensor:
        """Logits [B, V] with the rows whose matcher is not None masked to allowed tokens."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
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
