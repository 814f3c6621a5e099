"""Beam search on top of the engine, with vLLM's ``LLM.beam_search`` API.

Each round expands every live beam by one token: all beams of all prompts run as
one batch (``max_tokens=1`` with the top ``2 x beam_width`` logprobs), the best
``beam_width`` continuations per prompt survive, and beams that reach EOS are
set aside. The final ranking uses ``cum_logprob / len ** length_penalty``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

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


def beam_search(llm, prompts: list, params: BeamSearchParams, lora_request=None) -> list[BeamSearchOutput]:
    """Run beam search for every prompt; ``llm`` is a :class:`loramux.engine.LLM`."""
    from loramux.engine.sampling_params import SamplingParams

    engine = llm.llm_engine
    eos = engine.eos_token_ids
    loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
    step_params = SamplingParams(
        logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature
    )
    prompt_ids = [engine.tokenize(p)[1] for p in prompts]
    live = [[BeamSearchSequence(list(ids), lora_request=lr)] for ids, lr in zip(prompt_ids, loras, strict=True)]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        flat = [(i, b) for i, beams in enumerate(live) for b in beams]
        if not flat:
            break
        outs = llm.generate(
            [{"prompt_token_ids": b.tokens} for _, b in flat],
            step_params,
            lora_request=[b.lora_request for _, b in flat],
        )
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(flat, outs, strict=True):
            for token, lp in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(
                    beam.tokens + [token],
                    beam.logprobs + [{token: lp}],
                    beam.cum_logprob + lp.logprob,
                    lora_request=beam.lora_request,
                )
                if token in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    candidates[i].append(new)
        live = [
            sorted(c, key=lambda b: b.cum_logprob, reverse=True)[: params.beam_width] for c in candidates
        ]
    tokenizer = engine.tokenizer
    results = []
    for i, ids in enumerate(prompt_ids):
        for beam in live[i]:
            beam.finish_reason = beam.finish_reason or "length"
        pool = done[i] + live[i]
        best = sorted(pool, key=lambda b: _score(b, len(ids), params.length_penalty), reverse=True)
        best = best[: params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens[len(ids):], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
