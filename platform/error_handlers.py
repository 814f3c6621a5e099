"""The handlers that answer every error in the OpenAI shape, through the one table
(:func:`~loramux.platform.errors.error_table`), so OpenAI clients raise their matching
exception class and a connection is never reset."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loramux.platform.errors import (
    DEFAULT_CONTEXT,
    APIError,
    ErrorContext,
    error_table,
    to_api_error,
)

logger = logging.getLogger(__name__)

RejectionListener = Callable[[Request, APIError], None]
"""Called with every 429 answer (the dashboard's recent rejections, the metric)."""


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
