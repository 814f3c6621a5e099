"""OpenAI request and response bodies, with vLLM's extension fields, as pydantic models.

Every sampling field defaults to ``None`` so the service knows which ones the
caller set (an adapter's preset fills the others). Unknown fields are kept
(``extra="allow"``) and reported back as having had no effect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32 = 2**31 - 1
INT64 = 2**63 - 1

Int32 = Annotated[int, Field(ge=-INT32, le=INT32)]
TokenId = Annotated[int, Field(ge=0, le=INT32)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """Sampling parameters accepted under their OpenAI or vLLM names."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    n: Int32 | None = None
    best_of: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Annotated[int, Field(ge=-INT64 - 1, le=INT64)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    max_tokens: Int32 | None = None
    min_tokens: Int32 | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    use_beam_search: bool | None = None
    """vLLM: beam search of width best_of (default n); sampling parameters have no effect."""
    length_penalty: float | None = None
    early_stopping: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    response_format: dict[str, Any] | None = None
    """OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM: exactly one of json, json_object, regex, choice, grammar."""
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    model: str
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool | None = False
    suffix: str | None = None
    max_completion_tokens: Int32 | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant turn's calls (OpenAI shape; ``arguments`` as JSON text)."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""
    reasoning: str | None = None
    """An assistant turn's thought (vLLM's name; ``reasoning_content`` is accepted too)."""
    reasoning_content: str | None = None


class ToolFunction(BaseModel):
    """A function tool's declaration."""

    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object."""
    strict: bool | None = None
    """Constrain the arguments to ``parameters`` (see ``--tool-strict-level``)."""


class ChatTool(BaseModel):
    """One entry of ``tools``: only function tools are served."""

    type: Literal["function"] = "function"
    function: ToolFunction


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Int32 | None = None
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    """``none`` | ``auto`` (the default with tools) | ``required`` |
    ``{"type": "function", "function": {"name": ...}}``."""
    parallel_tool_calls: bool | None = None
    """False: at most one call per answer (default: any number)."""
    include_reasoning: bool | None = True
    """vLLM: False leaves the thought out of the answer (it is still split off)."""
    add_generation_prompt: bool | None = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    family: str | None = None
    """The base model's family and architecture (``qwen3 (Qwen3ForCausalLM)``); an adapter
    shows its base's."""


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _unset(value: Any) -> bool:
    return value is None


class CompletionUsage(BaseModel):
    """Token counts of one response (the OpenAI client's name)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: dict[str, int] | None = Field(None, exclude_if=_unset)
    """``{"reasoning_tokens": n}`` when a reasoning parser is in effect."""
    prompt_tokens_details: dict[str, int] | None = Field(None, exclude_if=_unset)
    """``{"cached_tokens": n}``: prompt tokens found in the prefix cache (an activated
    LoRA's context before its invocation is the base model's and hits it too)."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    """tokens, token_logprobs, top_logprobs, text_offset."""
    prompt_logprobs: list[Any] | None = Field(None, exclude_if=_unset)
    """vLLM: per prompt token, token id -> logprob, rank, decoded_token (when asked)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _ResponseHead(BaseModel):
    """What every completion body and stream chunk starts with."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class CompletionResponse(_ResponseHead):
    """The body of a non-streaming ``POST /v1/completions``."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: CompletionUsage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None
    """The thought, when a reasoning parser split it off (vLLM's name)."""
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    """``[{"id", "type": "function", "function": {"name", "arguments"}}]``."""


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    """content (token, logprob, bytes, top_logprobs per token), refusal."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_ResponseHead):
    """The body of a non-streaming ``POST /v1/chat/completions``."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_logprobs: list[Any] | None = Field(None, exclude_if=_unset)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": desc}
    for code, desc in (
        (400, "Invalid parameter (the message and `param` name it)"),
        (401, "Missing or invalid API key"),
        (404, "Unknown model or adapter"),
        (413, "Request body too large"),
        (429, "The waiting queue is full; retry after `Retry-After` seconds"),
        (503, "The engine is not running"),
    )
}
