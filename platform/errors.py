"""HTTP errors in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``.

One table, :func:`error_table`, maps every exception class the product raises (the
platform's :class:`APIError` family, the engine's, the adapters', the registry's, the
limits', and the dependency clients' failures) to its HTTP status, OpenAI error type
and code, and the ``status`` label of ``loramux_requests_total``; nothing else maps.
Services raise and never translate; :func:`to_api_error` renders any exception through
the table (a class without a row of its own takes its nearest base's; a test requires a
row for every product class). A failed dependency (database, object store, Redis) is
503 with ``Retry-After`` naming the dependency kind only; anything unexpected is a
generic 500: no SQL, URL, file path, bucket or digest reaches a client, the details go
to the log. The handlers that answer with it are in :mod:`.error_handlers`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

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
        row = row or row_of(type(self))
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


# --- what answers take from their exceptions -------------------------------------------
def _param(attr: str) -> Detail:
    return lambda e, ctx: {"param": getattr(e, attr)}


def _logged(message: str) -> Detail:
    """A fixed message for the client (the log has the exception)."""
    return lambda e, ctx: {"message": message}


def _dependency(kind: str) -> Detail:
    def detail(e: BaseException, ctx: ErrorContext) -> dict[str, Any]:
        after = ctx.dependency_retry_after
        return {"message": f"the {kind} is unavailable; try again in {after} s",
                "code": f"{kind.replace(' ', '_')}_unavailable",
                "headers": {"Retry-After": str(after)}}
    return detail


def _bulkhead(e: Any, ctx: ErrorContext) -> dict[str, Any]:
    return {"message": f"the {e.kind} is unavailable; try again in {e.retry_after} s",
            "code": f"{e.kind.replace(' ', '_')}_unavailable",
            "headers": {"Retry-After": str(e.retry_after)}}


def _retry_soon(e: BaseException, ctx: ErrorContext) -> dict[str, Any]:
    return {"message": f"{e}; retry after {ctx.retry_after} s",
            "headers": {"Retry-After": str(ctx.retry_after)}}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "set"}


def _validation(e: Any, ctx: ErrorContext) -> dict[str, Any]:
    """A request body that does not parse (FastAPI's, and the routes that parse their own
    bodies): the first error's field as ``param``."""
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = first.get("loc", ())
    if loc[:1] in (("body",), ("query",), ("path",), ("header",)):
        loc = loc[1:]
    names = []
    for part in loc:
        if isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[]-")):
            break  # a union member's tag, not a field
        names.append(str(part))
    param = ".".join(names) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return {"message": f"the request body is not valid JSON: {msg}", "code": "invalid_json"}
    where = f"{param}: " if param else ""
    extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return {"message": f"{where}{msg}{extra}", "param": param}


def _http(e: Any, ctx: ErrorContext) -> dict[str, Any]:
    return {"status": e.status_code, "message": str(e.detail) if e.detail else "error",
            "headers": dict(e.headers or {})}


# --- the table -------------------------------------------------------------------------
@functools.cache
def error_table() -> dict[type[BaseException], ErrorRow]:
    """The one map from exception classes to answers. Store and schema failures name no
    bucket, path or SQL: the client hears what to do, the log hears what happened."""
    import redis
    from fastapi.exceptions import RequestValidationError
    from sqlalchemy import exc as sa
    from starlette.exceptions import HTTPException

    from loramux.adapters.errors import AdapterValidationError
    from loramux.adapters.merge import MergeCheckError
    from loramux.engine import errors as e
    from loramux.platform.adapter_api.uploads import NothingToRead
    from loramux.platform.bulkheads import DependencyUnavailable
    from loramux.platform.cluster.roles import RoleConfigError
    from loramux.platform.cluster.routing import NoEngineAvailable
    from loramux.platform.inference_gateway.metrics_listener import ListenerStartError
    from loramux.platform.limits.request import RequestLimitError
    from loramux.platform.limits.tenant import (
        LimitError,
        LimiterUnavailable,
        RateLimited,
        RequestTooLarge,
    )
    from loramux.registry import errors as r

    bad = "invalid_request_error"
    server = "server_error"
    database = ErrorRow(503, server, log=True, detail=_dependency("database"))
    adapter_unservable = ErrorRow(422, bad, "invalid_adapter", "model", detail=lambda x, ctx: {
        "message": f"the adapter cannot be served: {x}"})
    return {
        # the platform's own (services raise these directly)
        APIError: ErrorRow(500, server),
        BadRequest: ErrorRow(400, bad),
        Unauthorized: ErrorRow(401, "authentication_error", "invalid_api_key"),
        Forbidden: ErrorRow(403, "permission_error", "forbidden"),
        NotFound: ErrorRow(404, bad, "not_found"),
        ModelNotFound: ErrorRow(404, bad, "model_not_found"),
        AdapterNotFoundError: ErrorRow(404, bad, "adapter_not_found"),
        Conflict: ErrorRow(409, bad, "conflict"),
        PayloadTooLarge: ErrorRow(413, bad, "payload_too_large"),
        UnsupportedMediaType: ErrorRow(415, bad, "unsupported_media_type"),
        Unprocessable: ErrorRow(422, bad, "invalid_adapter"),
        TooManyRequests: ErrorRow(429, "rate_limit_error", "queue_full"),
        RateLimitExceeded: ErrorRow(429, "rate_limit_exceeded", "rate_limit_exceeded"),
        ServiceUnavailable: ErrorRow(503, server, "service_unavailable"),
        NothingToRead: ErrorRow(400, bad, "source_not_found", "source"),
        RequestValidationError: ErrorRow(400, bad, "invalid_parameter", detail=_validation),
        HTTPException: ErrorRow(500, server, detail=_http),
        # the engine (loramux.engine.errors)
        e.EngineError: ErrorRow(500, server, "engine_error", log=True,
                                detail=_logged("the engine failed on this request")),
        e.PromptError: ErrorRow(400, bad, "invalid_parameter", "prompt"),
        e.ContextLengthError: ErrorRow(400, bad, "context_length_exceeded", detail=_param("param")),
        e.SamplingParamError: ErrorRow(400, bad, "invalid_parameter", detail=_param("param")),
        e.GrammarError: ErrorRow(400, bad, "invalid_grammar"),
        e.GrammarTimeoutError: ErrorRow(400, bad, "grammar_timeout"),
        e.QueueFullError: ErrorRow(429, "rate_limit_error", "queue_full", detail=_retry_soon),
        e.LoRAError: adapter_unservable,
        e.AdapterBrokenError: adapter_unservable,
        e.AdapterGoneError: ErrorRow(409, bad, "adapter_gone", "model"),
        e.EngineStepError: ErrorRow(500, server, "engine_step_failed"),
        e.AdapterNumericsError: ErrorRow(500, server, "adapter_numerics", "model"),
        e.EngineDeadError: ErrorRow(503, server, "engine_dead", detail=_retry_soon),
        e.OutOfBlocksError: ErrorRow(500, server, "engine_error", log=True,
                                     detail=_logged("the engine ran out of KV cache blocks")),
        e.ModelLoadError: ErrorRow(500, server, "model_load_failed", log=True,
                                   detail=_logged("the base model could not be loaded")),
        e.DefaultModelError: ErrorRow(500, server, "model_load_failed", log=True,
                                      detail=_logged("the default model could not be loaded")),
        # adapters
        AdapterValidationError: ErrorRow(422, bad, "invalid_adapter", detail=_param("field")),
        MergeCheckError: ErrorRow(500, server, "merge_check_failed", log=True, detail=_logged(
            "the merged model's logits differ from base + adapter; nothing was stored")),
        # the limits
        LimitError: ErrorRow(429, "rate_limit_exceeded", "rate_limit_exceeded",
                             detail=_param("limit")),
        RateLimited: ErrorRow(429, "rate_limit_exceeded", "rate_limit_exceeded",
                              detail=lambda x, ctx: {"param": x.limit, "headers": {
                                  "Retry-After": x.retry_after_header}}),
        RequestTooLarge: ErrorRow(400, bad, "request_too_large", detail=lambda x, ctx: {
            "message": f"{x}; retrying will not help", "param": x.limit}),
        LimiterUnavailable: ErrorRow(503, server, "limiter_unavailable",
                                     detail=lambda x, ctx: {"headers": {
                                         "Retry-After": str(ctx.dependency_retry_after)}}),
        RequestLimitError: ErrorRow(400, bad, "request_limit_exceeded", detail=_param("param")),
        # dependencies
        DependencyUnavailable: ErrorRow(503, server, log=True, detail=_bulkhead),
        sa.OperationalError: database,
        sa.InterfaceError: database,
        sa.TimeoutError: database,
        sa.DisconnectionError: database,
        redis.RedisError: ErrorRow(503, server, log=True, detail=_dependency("redis")),
        # the registry
        r.RegistryError: ErrorRow(500, server, "registry_error", log=True,
                                  detail=_logged("the adapter registry failed")),
        r.InvalidName: ErrorRow(400, bad, "invalid_name", "name"),
        r.InvalidPreset: ErrorRow(400, bad, "invalid_preset", "preset"),
        r.InvalidDescription: ErrorRow(400, bad, "invalid_description", "description"),
        r.InvalidQuota: ErrorRow(400, bad, "invalid_quota", "quotas"),
        r.QuotaExceeded: ErrorRow(403, "permission_error", "quota_exceeded",
                                  detail=_param("quota")),
        r.TenantNotFound: ErrorRow(401, "authentication_error", "invalid_api_key",
                                   detail=lambda x, ctx: {
                                       "message": "the key's tenant no longer exists"}),
        r.TenantConflict: ErrorRow(409, bad, "conflict", "name"),
        r.AdapterNotFound: ErrorRow(404, bad, "adapter_not_found", "name"),
        r.VersionNotFound: ErrorRow(404, bad, "version_not_found", "version"),
        r.InvalidRollout: ErrorRow(400, bad, "invalid_rollout", detail=_param("param")),
        r.VersionInUse: ErrorRow(409, bad, "version_in_rollout", "version"),
        r.NoPreviousVersion: ErrorRow(409, bad, "no_previous_version", "name"),
        r.AdapterConflict: ErrorRow(409, bad, "conflict", "name"),
        r.ObjectStoreError: ErrorRow(503, server, log=True, detail=_dependency("object store")),
        r.ObjectNotFound: ErrorRow(500, server, "adapter_weights_missing", log=True,
                                   detail=_logged("the adapter's weights are missing from the "
                                                  "object store; upload it again")),
        r.ObjectIntegrityError: ErrorRow(500, server, "adapter_weights_corrupt", log=True,
                                         detail=_logged("the adapter's stored weights are "
                                                        "corrupt; upload it again")),
        r.SchemaOutOfDate: ErrorRow(503, server, "service_unavailable", log=True,
                                    detail=_logged("the registry database needs `loramux db "
                                                   "upgrade`; try again later")),
        r.BaseModelNotConfigured: ErrorRow(503, server, "service_unavailable", log=True,
                                           detail=_logged("this server cannot validate "
                                                          "adapters; try again later")),
        # the cluster
        NoEngineAvailable: ErrorRow(503, server, "engine_dead", detail=_retry_soon),
        RoleConfigError: ErrorRow(500, server, "misconfigured", log=True,
                                  detail=_logged("the server is misconfigured")),
        # behind an inference gateway
        ListenerStartError: ErrorRow(500, server, "misconfigured", log=True,
                                     detail=_logged("the server is misconfigured")),
    }


def row_of(cls: type[BaseException]) -> ErrorRow | None:
    """The row of ``cls`` or of its nearest base that has one (None: not the product's)."""
    table = error_table()
    return next((table[c] for c in cls.__mro__ if c in table), None)


@functools.cache
def _status_rows() -> dict[int, ErrorRow]:
    """The APIError family's row of each status (the first listed wins): the answer to an
    exception that carries its own status (Starlette's HTTPException)."""
    rows: dict[int, ErrorRow] = {}
    for cls, row in error_table().items():
        if issubclass(cls, APIError):
            rows.setdefault(row.status, row)
    return rows


def status_row(status: int) -> ErrorRow:
    return _status_rows().get(status) or ErrorRow(
        status, "invalid_request_error" if status < 500 else "server_error")


DEFAULT_CONTEXT = ErrorContext()


def to_api_error(exc: BaseException, ctx: ErrorContext = DEFAULT_CONTEXT) -> APIError:
    """The HTTP error for an exception, by its class's row; an unexpected one is a
    generic 500 whose details only go to the log."""
    if isinstance(exc, APIError):
        return exc
    row = row_of(type(exc))
    if row is None:
        logger.error("unexpected error", exc_info=exc)
        return APIError("internal server error")
    fields: dict[str, Any] = {"message": str(exc), "param": row.param, "code": None}
    if row.detail is not None:
        fields.update(row.detail(exc, ctx))
    if row.log:
        logger.error("%s: %s: %s", fields["code"] or row.code or row.type, type(exc).__name__, exc)
    if "status" in fields:
        row = status_row(fields.pop("status"))
    if fields["param"] == "prompt":
        fields["param"] = ctx.prompt_param
    return APIError(row=row, **fields)


def metric_label(exc: BaseException) -> str:
    """The ``status`` label of a request that ended with ``exc``."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return "cancelled"
    if isinstance(exc, APIError):
        return exc.label
    row = row_of(type(exc))
    return row.label if row is not None else "error"
