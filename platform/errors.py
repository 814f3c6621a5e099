"""HTTP errors in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``.

Services raise: :class:`APIError` subclasses, or engine, adapter, registry and
dependency exceptions, which :func:`to_api_error` maps by class through one table
(:func:`error_table`); services do not translate. The handlers installed by
:func:`install_error_handlers` (one per row, and the catch-all) render them (and
FastAPI's validation errors) as JSON with the right status, so OpenAI clients raise
their matching exception class. A failed dependency (database, object store, Redis) is
503 with ``Retry-After`` naming the dependency kind only; anything unexpected is a
generic 500: no SQL, URL, file path, bucket or digest reaches a client; the details go
to the log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status, shown to the client in the OpenAI shape."""

    status_code = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
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
    status_code = 400
    type = "invalid_request_error"


class Unauthorized(APIError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(APIError):
    status_code = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(APIError):
    status_code = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class AdapterNotFoundError(NotFound):
    code = "adapter_not_found"


class Conflict(APIError):
    status_code = 409
    type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(APIError):
    status_code = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(APIError):
    status_code = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Unprocessable(APIError):
    status_code = 422
    type = "invalid_request_error"
    code = "invalid_adapter"


class TooManyRequests(APIError):
    status_code = 429
    type = "rate_limit_error"
    code = "queue_full"


class RateLimitExceeded(TooManyRequests):
    """Over a tenant quota now; ``Retry-After`` says when to try again."""

    type = "rate_limit_exceeded"
    code = "rate_limit_exceeded"


class ServiceUnavailable(APIError):
    status_code = 503
    type = "server_error"
    code = "service_unavailable"


@functools.cache
def error_table() -> list[tuple[tuple[type[BaseException], ...], Callable[[BaseException], APIError]]]:
    """The one map from exception classes (engine, adapters, registry) to HTTP errors;
    the first row whose classes match wins. Store and schema failures name no bucket,
    path or SQL: the client hears what to do, the log hears what happened."""
    import redis
    from sqlalchemy import exc as sa

    from loramux.adapters.errors import AdapterValidationError
    from loramux.engine.errors import (
        AdapterGoneError,
        AdapterNumericsError,
        ContextLengthError,
        EngineDeadError,
        EngineStepError,
        GrammarError,
        LoRAError,
        PromptError,
        QueueFullError,
        SamplingParamError,
    )
    from loramux.platform.bulkheads import DependencyPolicy, DependencyUnavailable
    from loramux.platform.limits.request import RequestLimitError
    from loramux.platform.limits.tenant import LimiterUnavailable, RateLimited, RequestTooLarge
    from loramux.registry import errors as r

    retry = DependencyPolicy().dependency_retry_after  # a bulkhead's own is on its error

    def unavailable(what: str) -> Callable[[BaseException], APIError]:
        def make(exc: BaseException) -> APIError:
            logger.error("%s: %s", what, exc)
            return ServiceUnavailable(f"{what}; try again later")
        return make

    def dependency(kind: str | None) -> Callable[[BaseException], APIError]:
        def make(exc: BaseException) -> APIError:
            name = kind or getattr(exc, "kind", "dependency")
            after = getattr(exc, "retry_after", retry)
            logger.error("%s unavailable: %s: %s", name, type(exc).__name__, exc)
            return ServiceUnavailable(
                f"the {name} is unavailable; try again in {after} s",
                code=f"{name.replace(' ', '_')}_unavailable",
                headers={"Retry-After": str(after)},
            )
        return make

    return [
        ((APIError,), lambda e: e),
        ((QueueFullError,), lambda e: TooManyRequests(str(e))),
        ((EngineDeadError,), lambda e: ServiceUnavailable(str(e), code="engine_dead")),
        ((AdapterGoneError,), lambda e: Conflict(str(e), param="model", code="adapter_gone")),
        ((AdapterNumericsError,), lambda e: APIError(str(e), param="model", code="adapter_numerics")),
        ((EngineStepError,), lambda e: APIError(str(e), code="engine_step_failed")),
        ((RateLimited,), lambda e: RateLimitExceeded(
            str(e), param=e.limit, headers={"Retry-After": e.retry_after_header})),
        ((RequestTooLarge,), lambda e: BadRequest(
            f"{e}; retrying will not help", param=e.limit, code="request_too_large")),
        ((LimiterUnavailable,), lambda e: ServiceUnavailable(
            str(e), code="limiter_unavailable", headers={"Retry-After": str(retry)})),
        ((DependencyUnavailable,), dependency(None)),
        ((sa.OperationalError, sa.InterfaceError, sa.TimeoutError, sa.DisconnectionError),
         dependency("database")),
        ((redis.RedisError,), dependency("redis")),
        ((ContextLengthError,), lambda e: BadRequest(str(e), param=e.param,
                                                     code="context_length_exceeded")),
        ((SamplingParamError,), lambda e: BadRequest(str(e), param=e.param,
                                                     code="invalid_parameter")),
        ((PromptError,), lambda e: BadRequest(str(e), param=e.param, code="invalid_parameter")),
        ((GrammarError,), lambda e: BadRequest(str(e), code="invalid_parameter")),
        ((RequestLimitError,), lambda e: BadRequest(str(e), param=e.param,
                                                    code="request_limit_exceeded")),
        ((r.QuotaExceeded,), lambda e: Forbidden(str(e), param=e.quota, code="quota_exceeded")),
        ((r.InvalidQuota,), lambda e: BadRequest(str(e), param="quotas", code="invalid_quota")),
        ((LoRAError,), lambda e: Unprocessable(f"the adapter cannot be served: {e}", param="model")),
        ((AdapterValidationError,), lambda e: Unprocessable(str(e), param=e.field)),
        ((r.AdapterNotFound,), lambda e: AdapterNotFoundError(str(e), param="name")),
        ((r.AdapterConflict, r.TenantConflict), lambda e: Conflict(str(e), param="name")),
        ((r.InvalidName,), lambda e: BadRequest(str(e), param="name", code="invalid_name")),
        ((r.InvalidPreset,), lambda e: BadRequest(str(e), param="preset", code="invalid_preset")),
        ((r.InvalidDescription,), lambda e: BadRequest(str(e), param="description")),
        ((r.TenantNotFound,), lambda e: Unauthorized("the key's tenant no longer exists")),
        ((r.ObjectStoreError,), dependency("object store")),
        ((r.SchemaOutOfDate,), unavailable("the registry database needs `loramux db upgrade`")),
        ((r.BaseModelNotConfigured,), unavailable("this server cannot validate adapters")),
    ]


def to_api_error(exc: BaseException) -> APIError:
    """The HTTP error for an exception, by its class (first match in the table); an
    unexpected one is a generic 500 whose details only go to the log."""
    for classes, make in error_table():
        if isinstance(exc, classes):
            return make(exc)
    logger.error("unexpected error", exc_info=exc)
    return APIError("internal server error")


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "set"}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = []
    for part in first.get("loc", ())[1:] if first.get("loc", ())[:1] in (("body",), ("query",), ("path",), ("header",)) else first.get("loc", ()):
        if isinstance(part, str) and (part in _TYPE_TAGS or any(c in part for c in "[]-")):
            break  # a union member's tag, not a field
        loc.append(str(part))
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return BadRequest(f"the request body is not valid JSON: {msg}", code="invalid_json")
    where = f"{param}: " if param else ""
    extra = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return BadRequest(f"{where}{msg}{extra}", param=param, code="invalid_parameter")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that render every error in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        listener = getattr(request.app.state, "rejection_listener", None)
        if exc.status_code == 429 and listener is not None:
            listener(request, exc)  # the dashboard's recent 429s
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        cls = {
            400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
            413: PayloadTooLarge, 422: Unprocessable, 429: TooManyRequests, 503: ServiceUnavailable,
        }.get(exc.status_code)
        message = str(exc.detail) if exc.detail else "error"
        if cls is None:
            err = APIError(message, headers=dict(exc.headers or {}))
            err.status_code = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
            return error_response(err)
        return error_response(cls(message, headers=dict(exc.headers or {})))

    async def _mapped(request: Request, exc: Exception):
        return error_response(to_api_error(exc))

    # One handler per row (Starlette's ExceptionMiddleware answers them and the connection
    # stays open); an ``Exception`` handler alone runs in ServerErrorMiddleware, which
    # re-raises after answering (uvicorn logs "Exception in ASGI application").
    for classes, _ in error_table():
        for cls in classes:
            if cls is not APIError:
                app.add_exception_handler(cls, _mapped)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.error("unhandled error on %s %s", request.method, request.url.path)
        return error_response(to_api_error(exc))
