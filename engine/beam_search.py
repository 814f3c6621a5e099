"""Beam search on top of the engine, with vLLM's ``LLM.beam_search`` API (and, through
``SamplingParams.use_beam_search``, the async engine's and the HTTP API's).

Each round expands every live beam by one token: all beams of all prompts run as
one batch (``max_tokens=1`` with the top ``2 x beam_width`` logprobs), the best
``beam_width`` continuations per prompt survive, and beams that reach EOS are
set aside. The final ranking uses ``cum_logprob / len ** length_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loramux.engine.intake import tokenize

BEAM_SEARCH_READS = frozenset({
    "n", "best_of", "max_tokens", "ignore_eos", "length_penalty", "early_stopping", "logprobs",
    "use_beam_search", "include_stop_str_in_output", "skip_special_tokens",
    "spaces_between_special_tokens", "detokenize",
})
"""The ``SamplingParams`` fields :func:`beam_search_request` honours; every other one has
no effect with ``use_beam_search`` (the HTTP layer warns about them)."""


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False
    """Stop a prompt's search once ``beam_width`` beams have finished (Hugging Face's True)."""

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included) and its score."""

    tokens: list[int]
    logprobs: list[dict] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: object | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def _score(beam: BeamSearchSequence, prompt_len: int, length_penalty: float) -> float:
    return beam.cum_logprob / (max(1, len(beam.tokens) - prompt_len) ** length_penalty)


class BeamSearch:
    """The state of a beam search over several prompts, driven round by round.

    A driver asks for :meth:`live` beams, runs each as a prompt with :attr:`step_params`
    (one token, top ``2 x beam_width`` logprobs) and hands the outputs to :meth:`advance`.
    Each round's prompts extend the last round's by one token, so the prefix cache
    serves every full block already computed: a round recomputes at most one block
    per beam, never the whole beam.
    """

    def __init__(self, prompt_ids: list[list[int]], params: BeamSearchParams, loras: list, eos: set[int]) -> None:
        from loramux.engine.sampling_params import SamplingParams

        self.params = params
        self.prompt_ids = prompt_ids
        self.eos = eos
        self.step_params = SamplingParams(
            logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature
        )
        self.live = [[BeamSearchSequence(list(ids), lora_request=lr)] for ids, lr in zip(prompt_ids, loras, strict=True)]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompt_ids]
        self.rounds = 0

    def pending(self) -> list[tuple[int, BeamSearchSequence]]:
        """(prompt index, beam) of every live beam; empty when the search is over."""
        if self.rounds >= self.params.max_tokens:
            return []
        return [(i, b) for i, beams in enumerate(self.live) for b in beams]

    def advance(self, flat: list[tuple[int, BeamSearchSequence]], outs: list) -> None:
        """Expand every beam of ``flat`` by the top tokens of its output and keep the best."""
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self.prompt_ids]
        for (i, beam), out in zip(flat, outs, strict=True):
            for token, lp in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(
                    beam.tokens + [token],
                    beam.logprobs + [{token: lp}],
                    beam.cum_logprob + lp.logprob,
                    lora_request=beam.lora_request,
                )
                if token in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.done[i].append(new)
                else:
                    candidates[i].append(new)
        width = self.params.beam_width
        self.live = [
            [] if self.params.early_stopping and len(self.done[i]) >= width
            else sorted(c, key=lambda b: b.cum_logprob, reverse=True)[:width]
            for i, c in enumerate(candidates)
        ]
        self.rounds += 1

    def results(self, tokenizers) -> list[BeamSearchOutput]:
        """The best ``beam_width`` beams of each prompt by length-penalized score, their text
        decoded with their adapter's tokenizer (``tokenizers.get(lora_request)``,
        :class:`~loramux.engine.adapter_tokenizers.AdapterTokenizers`)."""
        out = []
        for i, ids in enumerate(self.prompt_ids):
            for beam in self.live[i]:
                beam.finish_reason = beam.finish_reason or "length"
            pool = self.done[i] + self.live[i]
            best = sorted(pool, key=lambda b: _score(b, len(ids), self.params.length_penalty), reverse=True)
            best = best[: self.params.beam_width]
            for beam in best:
                beam.text = tokenizers.get(beam.lora_request).decode(beam.tokens[len(ids):],
                                                                     skip_special_tokens=True)
            out.append(BeamSearchOutput(best))
        return out


def beam_search(llm, prompts: list, params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
    """Run beam search for every prompt; ``llm`` is a :class:`loramux.engine.LLM`."""
    engine = llm.llm_engine
    loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
    tokenizers = engine.detokenizer.tokenizers
    search = BeamSearch([tokenize(tokenizers.get(lr), p)[1] for p, lr in zip(prompts, loras, strict=True)],
                        params, loras, engine.eos_token_ids)
    while flat := search.pending():
        outs = llm.generate(
            [{"prompt_token_ids": b.tokens} for _, b in flat],
            search.step_params,
            lora_request=[b.lora_request for _, b in flat],
        )
        search.advance(flat, outs)
    return search.results(tokenizers)


async def beam_search_request(engine, prompt, params, request_id: str, lora_request=None,
                              fairness_key: str | None = None):
    """Beam search for one prompt on an :class:`AsyncEngine` (``params.use_beam_search``):
    width ``params.best_of``, the ``params.n`` best beams returned as one finished
    :class:`RequestOutput`. Each round's beams run concurrently as one-token requests."""
    import asyncio
    import time

    from loramux.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    metrics = RequestMetrics(time.monotonic())
    core = engine.engine
    tokenizers = core.detokenizer.tokenizers
    text, ids = await engine.call(lambda: tokenize(tokenizers.get(lora_request), prompt))
    max_tokens = params.max_tokens or max(1, core.max_model_len - len(ids))
    search = BeamSearch(
        [ids],
        BeamSearchParams(params.best_of, max_tokens, ignore_eos=params.ignore_eos,
                         length_penalty=params.length_penalty, early_stopping=params.early_stopping),
        [lora_request],
        core.eos_token_ids,
    )

    async def expand(name: str, beam: BeamSearchSequence):
        last = None
        async for out in engine.generate({"prompt_token_ids": beam.tokens}, search.step_params, name,
                                         beam.lora_request, fairness_key=fairness_key):
            last = out
        return last

    while flat := search.pending():
        outs = await asyncio.gather(
            *(expand(f"{request_id}-r{search.rounds}-b{j}", b) for j, (_, b) in enumerate(flat))
        )
        search.advance(flat, outs)
    (result,) = search.results(tokenizers)
    metrics.first_token_time = metrics.finished_time = time.monotonic()
    outputs = [
        CompletionOutput(
            i, b.text or "", b.tokens[len(ids):], b.cum_logprob,
            b.logprobs if params.logprobs is not None else None, b.finish_reason,
            lora_request=lora_request,
        )
        for i, b in enumerate(result.sequences[: params.n])
    ]
    return RequestOutput(request_id, text, ids, None, outputs, True, metrics, lora_request)
