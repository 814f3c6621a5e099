"""HTTP errors in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``.

The platform's own :class:`APIError` family, each class answered by its :class:`ErrorRow`
(:data:`API_ERROR_ROWS`: HTTP status, OpenAI error type and code, and the ``status`` label of
``loramux_requests_total``), and the vocabulary every other row is written in
(:class:`ErrorRow`, :class:`ErrorContext`, :func:`label_for`). Services raise and never
translate. The one table from every exception class the product raises (the engine's, the
adapters', the registry's, the limits', the dependency clients') to its row, and the
handlers that answer with it, are in :mod:`.error_handlers`. This module imports nothing of
the platform, so every layer may raise its errors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

METRIC_LABELS = ("ok", "cancelled", "invalid", "rejected", "error")
"""The ``status`` label of ``loramux_requests_total``: finished, client gone, refused as
bad input (4xx), refused for load or quota (429), failed (5xx)."""


def label_for(status: int) -> str:
    """The metric label of an HTTP status (a row may name another)."""
    return "rejected" if status == 429 else "cancelled" if status == 499 else (
        "invalid" if 400 <= status < 500 else "error")


@dataclass(frozen=True)
class ErrorContext:
    """What only the server or the request knows of an error's answer."""

    prompt_param: str = "prompt"
    """The request field that holds the prompt (``prompt``; ``messages`` for chat)."""
    retry_after: int = 1
    """``Retry-After`` of a full queue or a restarting engine (``retry_after_seconds``)."""
    dependency_retry_after: int = 5
    """``Retry-After`` of a failed dependency (``dependency_retry_after``)."""


Detail = Callable[[Any, ErrorContext], dict[str, Any]]
"""What an answer takes from the exception: any of ``message``, ``param``, ``code``,
``headers`` (and ``status``, for exceptions that carry their own)."""


@dataclass(frozen=True)
class ErrorRow:
    """How one exception class is answered."""

    status: int
    type: str
    """The OpenAI error type (``invalid_request_error``, ``server_error``, ...)."""
    code: str | None = None
    param: str | None = None
    """``prompt`` means the request's prompt field (:attr:`ErrorContext.prompt_param`)."""
    label: str = ""
    """The metric label; empty = by status (:func:`label_for`)."""
    detail: Detail | None = None
    log: bool = False
    """Log the exception (what happened, for the operator; the client hears less)."""

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", label_for(self.status))


class APIError(Exception):
    """An error with an HTTP status, shown to the client in the OpenAI shape. A subclass's
    status, type and default code are its row of the table."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        row: ErrorRow | None = None,
    ) -> None:
        """``row``: answer by this row instead of the class's (the table's own use)."""
        super().__init__(message)
        row = row or api_row(type(self))
        self.message = message
        self.param = param
        self.status_code, self.type, self.label = row.status, row.type, row.label
        self.code = code if code is not None else row.code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class BadRequest(APIError):
    pass


class Unauthorized(APIError):
    pass


class Forbidden(APIError):
    pass


class NotFound(APIError):
    pass


class ModelNotFound(NotFound):
    pass


class AdapterNotFoundError(NotFound):
    pass


class Conflict(APIError):
    pass


class PayloadTooLarge(APIError):
    pass


class UnsupportedMediaType(APIError):
    pass


class Unprocessable(APIError):
    pass


class TooManyRequests(APIError):
    pass


class RateLimitExceeded(TooManyRequests):
    """Over a tenant quota now; ``Retry-After`` says when to try again."""


class ServiceUnavailable(APIError):
    pass


class RoleConfigError(ValueError):
    """A cluster role was asked for without what it needs (``loramux serve --role``)."""


_BAD = "invalid_request_error"
_SERVER = "server_error"

API_ERROR_ROWS: dict[type[APIError], ErrorRow] = {
    APIError: ErrorRow(500, _SERVER),
    BadRequest: ErrorRow(400, _BAD),
    Unauthorized: ErrorRow(401, "authentication_error", "invalid_api_key"),
    Forbidden: ErrorRow(403, "permission_error", "forbidden"),
    NotFound: ErrorRow(404, _BAD, "not_found"),
    ModelNotFound: ErrorRow(404, _BAD, "model_not_found"),
    AdapterNotFoundError: ErrorRow(404, _BAD, "adapter_not_found"),
    Conflict: ErrorRow(409, _BAD, "conflict"),
    PayloadTooLarge: ErrorRow(413, _BAD, "payload_too_large"),
    UnsupportedMediaType: ErrorRow(415, _BAD, "unsupported_media_type"),
    Unprocessable: ErrorRow(422, _BAD, "invalid_adapter"),
    TooManyRequests: ErrorRow(429, "rate_limit_error", "queue_full"),
    RateLimitExceeded: ErrorRow(429, "rate_limit_exceeded", "rate_limit_exceeded"),
    ServiceUnavailable: ErrorRow(503, _SERVER, "service_unavailable"),
}
"""The rows of the platform's own classes (the first of the table in ``error_handlers``)."""


def api_row(cls: type[APIError]) -> ErrorRow:
    """The row of an :class:`APIError` class, or of its nearest base that has one."""
    return next(API_ERROR_ROWS[c] for c in cls.__mro__ if c in API_ERROR_ROWS)


DEFAULT_CONTEXT = ErrorContext()
