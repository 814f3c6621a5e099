"""Caps on what one request may ask for, checked before it reaches the engine.

Every field of :class:`RequestLimits` bounds a tenant-controlled input whose cost is
otherwise unbounded: stop strings are matched against every new token, token-id lists
and ``logit_bias`` are applied to every row of every step, ``n × best_of`` multiplies the
sequences and ``prompt_logprobs`` the per-prompt-token work, templates and grammars run
arbitrary-size programs. The HTTP layer builds ``SamplingParams`` and then calls
:func:`check_request`; a :class:`RequestLimitError` maps to HTTP 400 with ``param``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the template worker process imports this package: keep torch out
    from loramux.engine.sampling_params import SamplingParams


class RequestLimitError(ValueError):
    """A request goes past one of the operator's caps. ``param`` names the request field
    (as in the OpenAI body) for the error's ``param``."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


@dataclass(frozen=True)
class RequestLimits:
    """The operator's caps on one request. Built once from settings; immutable."""

    max_stop: int = field(default=16, metadata={"doc": "Most ``stop`` strings."})
    max_stop_length: int = field(default=256, metadata={"doc": (
        "Longest ``stop`` string, in characters.")})
    max_stop_token_ids: int = field(default=256, metadata={"doc": "Most ``stop_token_ids``."})
    max_allowed_token_ids: int = field(default=4096, metadata={"doc": (
        "Most ``allowed_token_ids``.")})
    max_logit_bias: int = field(default=300, metadata={"doc": (
        "Most ``logit_bias`` entries (OpenAI's own cap).")})
    max_logprobs: int = field(default=20, metadata={"doc": (
        "Largest ``logprobs`` and ``prompt_logprobs`` (vLLM's ``max_logprobs``).")})
    max_request_work: int = field(default=1024, metadata={"doc": (
        "Most ``n × best_of × max(1, prompt_logprobs)``: sequences times per-token logprobs.")})
    trust_request_chat_template: bool = field(default=False, metadata={"doc": (
        "Accept a caller's own ``chat_template`` (vLLM's ``--trust-request-chat-template``).")})
    max_chat_template_chars: int = field(default=65536, metadata={"doc": (
        "Longest caller-supplied chat template, in characters.")})
    chat_template_render_timeout_s: float = field(default=2.0, metadata={"doc": (
        "A template render is killed after this long (it runs in a worker process).")})
    max_rendered_prompt_chars: int = field(default=2_000_000, metadata={"doc": (
        "Longest text a chat template may render.")})
    max_grammar_chars: int = field(default=65536, metadata={"doc": (
        "Longest structured-output spec (JSON schema, regex, choices or EBNF, serialized).")})
    max_tools: int = field(default=128, metadata={"doc": (
        "Most ``tools`` one chat request may declare (each is rendered into the prompt and "
        "may be compiled into the request's grammar).")})

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be true or false, got {value!r}")
            elif f.type == "float":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"{f.name} must be a number of seconds > 0, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")


def _cap(param: str, count: int, limit: int, what: str, setting: str) -> None:
    if count > limit:
        raise RequestLimitError(
            param, f"{param} has {count} {what}, more than this server allows ({limit}, {setting})"
        )


def check_request(params: SamplingParams, limits: RequestLimits) -> None:
    """Raise :class:`RequestLimitError` naming the first field past a cap. Called once per
    request after its ``SamplingParams`` are built (preset merged), before admission."""
    _cap("stop", len(params.stop_strings), limits.max_stop, "strings", "max_stop")
    for s in params.stop_strings:
        if len(s) > limits.max_stop_length:
            raise RequestLimitError(
                "stop",
                f"stop has a string of {len(s)} characters, longer than this server allows "
                f"({limits.max_stop_length}, max_stop_length)",
            )
    _cap("stop_token_ids", len(params.stop_token_ids), limits.max_stop_token_ids, "ids",
         "max_stop_token_ids")
    _cap("allowed_token_ids", len(params.allowed_token_ids or ()), limits.max_allowed_token_ids,
         "ids", "max_allowed_token_ids")
    _cap("logit_bias", len(params.logit_bias or {}), limits.max_logit_bias, "entries",
         "max_logit_bias")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise RequestLimitError(
                name, f"{name} is {value}, more than this server allows "
                f"({limits.max_logprobs}, max_logprobs)",
            )  # fmt: skip
    spec = params.structured_outputs
    if spec is not None and len(spec.cache_key()) > limits.max_grammar_chars:
        raise RequestLimitError(
            "structured_outputs",
            f"structured_outputs is {len(spec.cache_key())} characters serialized, more than "
            f"this server allows ({limits.max_grammar_chars}, max_grammar_chars)",
        )
    work = params.n * params.best_of * max(1, params.prompt_logprobs or 0)
    if work > limits.max_request_work:
        raise RequestLimitError(
            "n",
            f"n × best_of × prompt_logprobs = {params.n} × {params.best_of} × "
            f"{max(1, params.prompt_logprobs or 0)} = {work}, more than this server allows "
            f"({limits.max_request_work}, max_request_work); lower n, best_of or prompt_logprobs",
        )


def check_chat_template(template: str | None, limits: RequestLimits) -> None:
    """Refuse a caller-supplied chat template unless the operator trusts them, and one
    longer than ``max_chat_template_chars``. Called before rendering a chat request."""
    if template is None:
        return
    if not limits.trust_request_chat_template:
        raise RequestLimitError(
            "chat_template",
            "chat_template is not accepted by this server; leave it out to use the model's "
            "own template (the operator can allow it with --trust-request-chat-template)",
        )
    if not isinstance(template, str):
        raise RequestLimitError("chat_template", "chat_template must be a string")
    if len(template) > limits.max_chat_template_chars:
        raise RequestLimitError(
            "chat_template",
            f"chat_template has {len(template)} characters, more than this server allows "
            f"({limits.max_chat_template_chars}, max_chat_template_chars)",
        )
