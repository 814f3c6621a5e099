"""The Responses API's request and answer bodies (OpenAI's field names).

Input items, tools and ``text.format`` stay plain dicts here: :mod:`.convert` checks them
one by one so that every refusal names its field (``input[2].type``). Unknown fields are
kept (``extra="allow"``) and reported back as having had no effect.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | list[Any]
    """Text (one user message) or a list of items: messages, ``function_call``,
    ``function_call_output`` and ``reasoning`` items."""
    instructions: str | None = None
    """A leading system message for this response only (not carried over through
    ``previous_response_id``)."""
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    """Function tools in the Responses flat form: ``{"type": "function", "name", ...}``."""
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    """``{"format": {"type": "text" | "json_object" | "json_schema", ...}}``."""
    store: bool | None = True
    previous_response_id: Annotated[str, Field(max_length=80)] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool | None = False

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} pairs, got {len(value)}")
        for k, v in value.items():
            if len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE:
                raise ValueError(f"keys hold at most {MAX_METADATA_KEY} characters and values "
                                 f"{MAX_METADATA_VALUE}")
        return value


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    """``{"cached_tokens": n}``."""
    output_tokens: int
    output_tokens_details: dict[str, int]
    """``{"reasoning_tokens": n}``."""
    total_tokens: int


class ResponseObject(BaseModel):
    """A response (``POST /v1/responses`` without ``stream``, ``GET /v1/responses/{id}``)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    """``reasoning``, ``message`` and ``function_call`` items."""
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    """``DELETE /v1/responses/{id}``."""

    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
