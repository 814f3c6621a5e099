"""HTTP errors in the OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``.

Services raise :class:`APIError` subclasses; the handlers installed by
:func:`install_error_handlers` turn them (and FastAPI's validation errors, and
engine and registry exceptions that escape a service) into JSON responses with
the right status, so OpenAI clients raise their matching exception class.
"""

from __future__ import annotations

import logging
import re

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


class ServiceUnavailable(APIError):
    status_code = 503
    type = "server_error"
    code = "service_unavailable"


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


_PARAM_RE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\b")


def param_of(message: str, known: set[str] | frozenset[str]) -> str | None:
    """The parameter a ValueError message names first (engine messages start with it)."""
    m = _PARAM_RE.match(message)
    if m and m.group(1) in known:
        return m.group(1)
    for name in sorted(known, key=len, reverse=True):
        if re.search(rf"\b{re.escape(name)}\b", message):
            return name
    return None


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
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        cls = {
            400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict,
            413: PayloadTooLarge, 422: Unprocessable, 429: TooManyRequests, 503: ServiceUnavailable,
        }.get(exc.status_code)
        message = str(exc.detail) if exc.detail else "error"
        if cls is None:
            err = APIError(message, headers=dict(exc.headers or {}))
            err.status_code = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
            return error_response(err)
        return error_response(cls(message, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError("internal server error"))
