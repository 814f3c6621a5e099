"""Per-request sampling parameters with vLLM's names, defaults and validation."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from loramux.engine.errors import SamplingParamError
from loramux.engine.structured_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
_MIN_TEMPERATURE = 1e-2
_MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How to pick tokens for one request (vLLM semantics).

    Validated on construction: a bad value raises ``ValueError`` naming the
    parameter and its allowed range.
    """

    n: int = 1
    """Completions returned for the prompt."""
    best_of: int | None = None
    """Completions generated; the ``n`` with the highest cumulative logprob are returned."""
    presence_penalty: float = 0.0
    """Added once to every token already generated (OpenAI semantics), in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Added per occurrence of a generated token (OpenAI semantics), in [-2, 2]."""
    repetition_penalty: float = 1.0
    """Hugging Face multiplicative penalty over prompt and generated tokens, > 0."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 = off."""
    min_p: float = 0.0
    """Drop tokens below min_p x the top probability, in [0, 1]."""
    seed: int | None = None
    """Per-request generator: the same seed gives the same tokens whatever else is in the batch."""
    stop: str | list[str] | None = None
    """Strings that end generation; cut from the text."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation."""
    ignore_eos: bool = False
    """Keep generating past the EOS token."""
    max_tokens: int | None = 16
    """Most tokens to generate; None = up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop tokens are blocked until this many tokens exist."""
    logprobs: int | None = None
    """Return the sampled token's logprob and the top-N alternatives."""
    prompt_logprobs: int | None = None
    """Return the top-N logprobs of every prompt token."""
    logit_bias: dict[int, float] | None = None
    """Added to the logits of the given token ids, each in [-100, 100]."""
    allowed_token_ids: list[int] | None = None
    """Restrict sampling to these token ids."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    """Constrain the output to a JSON schema, JSON object, regex, choice, EBNF grammar or
    structural tag (from the end of the thought on with ``reasoning_end``)."""
    use_beam_search: bool = False
    """Beam search of width ``best_of`` (defaults to ``n``), returning the ``n`` best beams.
    Sampling parameters (temperature, top_p, top_k, min_p, penalties, seed) have no effect."""
    length_penalty: float = 1.0
    """Beam search: beams are ranked by cum_logprob / len ** length_penalty."""
    early_stopping: bool = False
    """Beam search: stop once ``best_of`` beams have finished."""
    stop_strings: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = _list("stop", self.stop)
        self.stop_token_ids = _list("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _list("allowed_token_ids", self.allowed_token_ids)
        if self.logit_bias:
            if not isinstance(self.logit_bias, dict):
                raise SamplingParamError(
                    "logit_bias",
                    f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}."
                )
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise SamplingParamError(
                    "logit_bias",
                    f"logit_bias must map integer token ids to numbers, got {self.logit_bias!r}."
                ) from None
        if 0 < _number("temperature", self.temperature) < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors nan or inf "
                "in tensors. We have maxed it out to %s.",
                self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE,
            )
            self.temperature = _MIN_TEMPERATURE
        self._verify()
        if self.top_k == -1:
            self.top_k = 0

    def _verify(self) -> None:
        """Every field's vLLM check (``SamplingParamError`` names the field)."""
        self._verify_counts()
        self._verify_distribution()
        self._verify_lengths()
        self._verify_token_lists()

    def _verify_counts(self) -> None:
        """n, best_of and beam search's flags."""
        _int("n", self.n)
        if self.n < 1:
            raise SamplingParamError("n", f"n must be at least 1, got {self.n}.")
        _int("best_of", self.best_of)
        if self.best_of < self.n:
            raise SamplingParamError(
                "best_of",
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}."
            )
        _number("length_penalty", self.length_penalty)
        for name in ("use_beam_search", "early_stopping"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamError(name, f"{name} must be true or false, got {getattr(self, name)!r}.")
        if not self.use_beam_search and self.is_greedy and self.best_of > 1 and self.best_of != self.n:
            raise SamplingParamError(
                "best_of",
                f"best_of must be 1 (or equal to n) when using greedy sampling, got {self.best_of}."
            )

    def _verify_distribution(self) -> None:
        """Penalties, temperature, top-p / top-k / min-p."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise SamplingParamError(name, f"{name} must be in [-2, 2], got {value}.")
        if _number("repetition_penalty", self.repetition_penalty) <= 0.0:
            raise SamplingParamError(
                "repetition_penalty",
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        if _number("temperature", self.temperature) < 0.0:
            raise SamplingParamError("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < _number("top_p", self.top_p) <= 1.0:
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        _int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamError("top_k", f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= _number("min_p", self.min_p) <= 1.0:
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}.")

    def _verify_lengths(self) -> None:
        """max/min tokens, logprob counts and the seed."""
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise SamplingParamError("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise SamplingParamError(
                "min_tokens",
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}."
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamError(
                "min_tokens",
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int(name, value)
                if value < 0:
                    raise SamplingParamError(name, f"{name} must be non-negative, got {value}.")
        if self.seed is not None:
            _int("seed", self.seed)

    def _verify_token_lists(self) -> None:
        """Stop strings and ids, logit bias, allowed tokens."""
        for s in self.stop_strings:
            if not isinstance(s, str):
                raise SamplingParamError("stop", f"stop must be a string or a list of strings, got {s!r}.")
            if s == "":
                raise SamplingParamError("stop", "stop cannot contain an empty string.")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t)
            if t < 0:
                raise SamplingParamError("stop_token_ids", f"stop_token_ids must be non-negative token ids, got {t}.")
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise SamplingParamError("logit_bias", f"logit_bias keys must be non-negative token ids, got {token}.")
            if not -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS:
                raise SamplingParamError(
                    "logit_bias",
                    f"logit_bias values must be in [-100, 100], got {bias} for token {token}."
                )
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise SamplingParamError("allowed_token_ids", "allowed_token_ids must not be empty.")
            for t in self.allowed_token_ids:
                _int("allowed_token_ids", t)
                if t < 0:
                    raise SamplingParamError("allowed_token_ids", f"allowed_token_ids must be non-negative, got {t}.")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature 0)."""
        return self.temperature < _SAMPLING_EPS

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary; called when a request is added."""
        ends = (self.structured_outputs.reasoning_end if self.structured_outputs else None) or []
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list((self.logit_bias or {}).keys())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("structured_outputs.reasoning_end", [t for end in ends for t in end]),
        ):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise SamplingParamError(
                    name,
                    f"{name} contains token id {bad[0]} outside the vocabulary "
                    f"(size {vocab_size})."
                )

    def clone(self, **changes) -> SamplingParams:
        """A copy with some fields replaced (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(changes)
        return SamplingParams(**values)


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamError(name, f"{name} must be an integer, got {value!r}.")
    return value


def _list(name: str, value) -> list:
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise SamplingParamError(name, f"{name} must be a list, got {value!r}.")
    return list(value)


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamError(name, f"{name} must be a number, got {value!r}.")
    if value != value:
        raise SamplingParamError(name, f"{name} must be a number, got NaN.")
    return float(value)
