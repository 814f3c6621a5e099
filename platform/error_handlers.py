"""Every error answered in the OpenAI shape, through one table.

:func:`error_table` maps every exception class the product raises (the platform's
:class:`~.errors.APIError` family, the engine's, the adapters', the registry's, the limits',
and the dependency clients' failures) to its HTTP status, OpenAI error type and code, and the
``status`` label of ``loramux_requests_total``; nothing else maps. :func:`to_api_error`
renders any exception through the table (a class without a row of its own takes its nearest
base's; a test requires a row for every product class). A failed dependency (database, object
store, Redis) is 503 with ``Retry-After`` naming the dependency kind only; anything
unexpected is a generic 500: no SQL, URL, file path, bucket or digest reaches a client, the
details go to the log. :func:`install_error_handlers` answers with it, so OpenAI clients
raise their matching exception class and a connection is never reset.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loramux.platform.errors import (
    API_ERROR_ROWS,
    DEFAULT_CONTEXT,
    APIError,
    Detail,
    ErrorContext,
    ErrorRow,
    RoleConfigError,
)

logger = logging.getLogger(__name__)

RejectionListener = Callable[[Request, APIError], None]
"""Called with every 429 answer (the dashboard's recent rejections, the metric)."""

_BAD = "invalid_request_error"
_SERVER = "server_error"


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
Rows = dict[type[BaseException], ErrorRow]


def _request_rows() -> Rows:
    """The request's own shape: FastAPI's body validation, Starlette's HTTP errors, an
    upload source that does not exist."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from loramux.platform.adapter_api.uploads import NothingToRead

    return {
        NothingToRead: ErrorRow(400, _BAD, "source_not_found", "source"),
        RequestValidationError: ErrorRow(400, _BAD, "invalid_parameter", detail=_validation),
        HTTPException: ErrorRow(500, _SERVER, detail=_http),
    }


def _engine_rows() -> Rows:
    """The engine's (``loramux.engine.errors``)."""
    from loramux.engine import errors as e

    adapter_unservable = ErrorRow(422, _BAD, "invalid_adapter", "model", detail=lambda x, ctx: {
        "message": f"the adapter cannot be served: {x}"})
    return {
        e.EngineError: ErrorRow(500, _SERVER, "engine_error", log=True,
                                detail=_logged("the engine failed on this request")),
        e.PromptError: ErrorRow(400, _BAD, "invalid_parameter", "prompt"),
        e.ContextLengthError: ErrorRow(400, _BAD, "context_length_exceeded", detail=_param("param")),
        e.SamplingParamError: ErrorRow(400, _BAD, "invalid_parameter", detail=_param("param")),
        e.GrammarError: ErrorRow(400, _BAD, "invalid_grammar"),
        e.GrammarTimeoutError: ErrorRow(400, _BAD, "grammar_timeout"),
        e.QueueFullError: ErrorRow(429, "rate_limit_error", "queue_full", detail=_retry_soon),
        e.LoRAError: adapter_unservable,
        e.AdapterBrokenError: adapter_unservable,
        e.AdapterGoneError: ErrorRow(409, _BAD, "adapter_gone", "model"),
        e.EngineStepError: ErrorRow(500, _SERVER, "engine_step_failed"),
        e.AdapterNumericsError: ErrorRow(500, _SERVER, "adapter_numerics", "model"),
        e.EngineDeadError: ErrorRow(503, _SERVER, "engine_dead", detail=_retry_soon),
        e.CollectiveError: ErrorRow(503, _SERVER, "engine_dead", detail=_retry_soon),
        e.OutOfBlocksError: ErrorRow(500, _SERVER, "engine_error", log=True,
                                     detail=_logged("the engine ran out of KV cache blocks")),
        e.ModelLoadError: ErrorRow(500, _SERVER, "model_load_failed", log=True,
                                   detail=_logged("the base model could not be loaded")),
        e.DefaultModelError: ErrorRow(500, _SERVER, "model_load_failed", log=True,
                                      detail=_logged("the default model could not be loaded")),
    }


def _adapter_rows() -> Rows:
    """The adapter format's checks and the merge check."""
    from loramux.adapters.errors import AdapterValidationError
    from loramux.adapters.merge import MergeCheckError

    return {
        AdapterValidationError: ErrorRow(422, _BAD, "invalid_adapter", detail=_param("field")),
        MergeCheckError: ErrorRow(500, _SERVER, "merge_check_failed", log=True, detail=_logged(
            "the merged model's logits differ from base + adapter; nothing was stored")),
    }


def _limit_rows() -> Rows:
    """The tenant limits and the per-request caps."""
    from loramux.platform.limits.request import RequestLimitError
    from loramux.platform.limits.tenant import (
        LimitError,
        LimiterUnavailable,
        RateLimited,
        RequestTooLarge,
    )

    return {
        LimitError: ErrorRow(429, "rate_limit_exceeded", "rate_limit_exceeded",
                             detail=_param("limit")),
        RateLimited: ErrorRow(429, "rate_limit_exceeded", "rate_limit_exceeded",
                              detail=lambda x, ctx: {"param": x.limit, "headers": {
                                  "Retry-After": x.retry_after_header}}),
        RequestTooLarge: ErrorRow(400, _BAD, "request_too_large", detail=lambda x, ctx: {
            "message": f"{x}; retrying will not help", "param": x.limit}),
        LimiterUnavailable: ErrorRow(503, _SERVER, "limiter_unavailable",
                                     detail=lambda x, ctx: {"headers": {
                                         "Retry-After": str(ctx.dependency_retry_after)}}),
        RequestLimitError: ErrorRow(400, _BAD, "request_limit_exceeded", detail=_param("param")),
    }


def _dependency_rows() -> Rows:
    """A failed database, Redis, or a bulkhead that refused the call."""
    import redis
    from sqlalchemy import exc as sa

    from loramux.platform.bulkheads import DependencyUnavailable

    database = ErrorRow(503, _SERVER, log=True, detail=_dependency("database"))
    return {
        DependencyUnavailable: ErrorRow(503, _SERVER, log=True, detail=_bulkhead),
        sa.OperationalError: database,
        sa.InterfaceError: database,
        sa.TimeoutError: database,
        sa.DisconnectionError: database,
        redis.RedisError: ErrorRow(503, _SERVER, log=True, detail=_dependency("redis")),
    }


def _registry_rows() -> Rows:
    """The registry's (``loramux.registry.errors``): store and schema failures name no
    bucket, path or SQL."""
    from loramux.registry import errors as r

    return {
        r.RegistryError: ErrorRow(500, _SERVER, "registry_error", log=True,
                                  detail=_logged("the adapter registry failed")),
        r.InvalidName: ErrorRow(400, _BAD, "invalid_name", "name"),
        r.InvalidPreset: ErrorRow(400, _BAD, "invalid_preset", "preset"),
        r.InvalidDescription: ErrorRow(400, _BAD, "invalid_description", "description"),
        r.InvalidChatSettings: ErrorRow(422, _BAD, "invalid_chat_settings",
                                        detail=_param("param")),
        r.InvalidQuota: ErrorRow(400, _BAD, "invalid_quota", "quotas"),
        r.QuotaExceeded: ErrorRow(403, "permission_error", "quota_exceeded",
                                  detail=_param("quota")),
        r.TenantNotFound: ErrorRow(401, "authentication_error", "invalid_api_key",
                                   detail=lambda x, ctx: {
                                       "message": "the key's tenant no longer exists"}),
        r.TenantConflict: ErrorRow(409, _BAD, "conflict", "name"),
        r.AdapterNotFound: ErrorRow(404, _BAD, "adapter_not_found", "name"),
        r.VersionNotFound: ErrorRow(404, _BAD, "version_not_found", "version"),
        r.InvalidRollout: ErrorRow(400, _BAD, "invalid_rollout", detail=_param("param")),
        r.VersionInUse: ErrorRow(409, _BAD, "version_in_rollout", "version"),
        r.NoPreviousVersion: ErrorRow(409, _BAD, "no_previous_version", "name"),
        r.AdapterConflict: ErrorRow(409, _BAD, "conflict", "name"),
        r.ObjectStoreError: ErrorRow(503, _SERVER, log=True, detail=_dependency("object store")),
        r.ObjectNotFound: ErrorRow(500, _SERVER, "adapter_weights_missing", log=True,
                                   detail=_logged("the adapter's weights are missing from the "
                                                  "object store; upload it again")),
        r.ObjectIntegrityError: ErrorRow(500, _SERVER, "adapter_weights_corrupt", log=True,
                                         detail=_logged("the adapter's stored weights are "
                                                        "corrupt; upload it again")),
        r.SchemaOutOfDate: ErrorRow(503, _SERVER, "service_unavailable", log=True,
                                    detail=_logged("the registry database needs `loramux db "
                                                   "upgrade`; try again later")),
        r.BaseModelNotConfigured: ErrorRow(503, _SERVER, "service_unavailable", log=True,
                                           detail=_logged("this server cannot validate "
                                                          "adapters; try again later")),
    }


def _deployment_rows() -> Rows:
    """The cluster's and the inference-gateway side's: no engine to route to, a server
    started without what its role needs."""
    from loramux.platform.cluster.routing import NoEngineAvailable
    from loramux.platform.inference_gateway.metrics_listener import ListenerStartError

    misconfigured = _logged("the server is misconfigured")
    return {
        NoEngineAvailable: ErrorRow(503, _SERVER, "engine_dead", detail=_retry_soon),
        RoleConfigError: ErrorRow(500, _SERVER, "misconfigured", log=True, detail=misconfigured),
        ListenerStartError: ErrorRow(500, _SERVER, "misconfigured", log=True,
                                     detail=misconfigured),
    }


def _parser_rows() -> Rows:
    """The tool-call and reasoning parsers': a start-up refusal, and the parse errors their
    ``safe_*`` methods turn into content (a row all the same, should one ever escape)."""
    from loramux.platform.openai.parsers.partial_json import MalformedJSON, _Incomplete
    from loramux.platform.openai.parsers.pythonic_ast import UnexpectedAstError
    from loramux.platform.openai.parsers.registry import ParserStartupError

    failed = _logged("the model's output could not be parsed; retry the request")
    return {
        ParserStartupError: ErrorRow(500, _SERVER, "misconfigured", log=True,
                                     detail=_logged("the server is misconfigured")),
        MalformedJSON: ErrorRow(500, _SERVER, log=True, detail=failed),
        _Incomplete: ErrorRow(500, _SERVER, log=True, detail=failed),
        UnexpectedAstError: ErrorRow(500, _SERVER, log=True, detail=failed),
    }


@functools.cache
def error_table() -> dict[type[BaseException], ErrorRow]:
    """The one map from exception classes to answers (built once, on first use). The
    client hears what to do, the log hears what happened."""
    return {**API_ERROR_ROWS, **_request_rows(), **_engine_rows(), **_adapter_rows(),
            **_limit_rows(), **_dependency_rows(), **_registry_rows(), **_deployment_rows(),
            **_parser_rows()}


def row_of(cls: type[BaseException]) -> ErrorRow | None:
    """The row of ``cls`` or of its nearest base that has one (None: not the product's)."""
    table = error_table()
    return next((table[c] for c in cls.__mro__ if c in table), None)


def status_row(status: int) -> ErrorRow:
    """The APIError family's row of ``status`` (the first listed wins): the answer to an
    exception that carries its own status (Starlette's HTTPException)."""
    row = next((r for r in API_ERROR_ROWS.values() if r.status == status), None)
    return row or ErrorRow(status, _BAD if status < 500 else _SERVER)


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


# --- the handlers ----------------------------------------------------------------------
def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)


def install_error_handlers(app: FastAPI, ctx: ErrorContext = DEFAULT_CONTEXT,
                           on_rejection: RejectionListener | None = None) -> None:
    """Answer every class of the table (and anything else, as a 500) in the OpenAI shape;
    ``ctx``: the server's ``Retry-After`` values."""

    def answer(request: Request, exc: BaseException) -> JSONResponse:
        err = to_api_error(exc, ctx)
        if err.status_code == 429 and on_rejection is not None:
            on_rejection(request, err)
        return error_response(err)

    async def _mapped(request: Request, exc: Exception) -> JSONResponse:
        return answer(request, exc)

    # One handler per row (Starlette's ExceptionMiddleware answers them and the connection
    # stays open); an ``Exception`` handler alone runs in ServerErrorMiddleware, which
    # re-raises after answering (uvicorn logs "Exception in ASGI application").
    for cls in error_table():
        app.add_exception_handler(cls, _mapped)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, exc)
