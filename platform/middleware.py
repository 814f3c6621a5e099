"""Pure ASGI middleware (no BaseHTTPMiddleware: it breaks disconnect detection).

* :class:`RequestContextMiddleware` gives each request an id (``X-Request-Id`` in and
  out), logs one access line with status and duration, and refuses JSON bodies larger
  than ``max_request_bytes`` with 413 (adapter uploads have their own, larger cap).
  It counts the requests in flight for a graceful shutdown and, while the server
  drains (:mod:`loramux.platform.drain`), answers new ones 503 with ``Retry-After``.
  An exception no handler took is answered through the error table here (a 503 for a
  failed dependency, else a generic 500), so the client's connection is not reset.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loramux.platform.drain import Drain
from loramux.platform.error_handlers import to_api_error
from loramux.platform.errors import PayloadTooLarge, ServiceUnavailable
from loramux.platform.logs import request_id_var

logger = logging.getLogger("loramux.access")

_ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


DRAIN_EXEMPT = ("/health", "/ready", "/metrics")
"""Paths still answered while the server drains (probes and scrapes)."""


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, max_request_bytes: int, unlimited_paths: tuple[str, ...] = (),
                 drain: Drain | None = None):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.unlimited = set(unlimited_paths)
        self.drain = drain
        """Counts the requests in flight; while draining, new ones get 503."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _ID_RE.match(given) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        start = time.perf_counter()
        status = {"code": 500}
        path = scope.get("path", "")
        limited = path.rstrip("/") not in self.unlimited

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["started"] = True
                raw = list(message.get("headers") or [])
                raw.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": raw}
            await send(message)

        drain = self.drain
        if drain is not None:
            drain.active += 1
        try:
            if drain is not None and drain.draining and path not in DRAIN_EXEMPT:
                await self._send_json(send_wrapper, ServiceUnavailable(
                    "the server is shutting down; retry (another replica will answer)",
                    code="shutting_down", headers={"Retry-After": "1", "Connection": "close"}))
                return
            if limited and scope.get("method") in ("POST", "PUT", "PATCH"):
                length = headers.get(b"content-length")
                if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
                    await self._reject(send_wrapper)
                    return
                buffered = await self._read_body(receive)
                if buffered is None:
                    await self._reject(send_wrapper)
                    return
                receive = self._replay(buffered, receive)
            try:
                await self.app(scope, receive, send_wrapper)
            except Exception as exc:
                if status.get("started"):
                    raise  # a stream already under way: nothing left to answer with
                await self._send_json(send_wrapper, to_api_error(exc))
        finally:
            if drain is not None:
                drain.active -= 1
            logger.info(
                "%s %s %s",
                scope.get("method"), path, status["code"],
                extra={
                    "method": scope.get("method"),
                    "path": path,
                    "status": status["code"],
                    "duration_ms": round((time.perf_counter() - start) * 1000, 2),
                    "client": (scope.get("client") or ("-",))[0],
                },
            )
            request_id_var.reset(token)

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The request's body messages, or None once they exceed the limit."""
        messages: list[Message] = []
        seen = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                return messages
            seen += len(message.get("body", b""))
            if seen > self.max_request_bytes:
                return None
            if not message.get("more_body", False):
                return messages

    @staticmethod
    def _replay(messages: list[Message], receive: Receive) -> Receive:
        pending = list(messages)

        async def replay() -> Message:
            if pending:
                return pending.pop(0)
            return await receive()

        return replay

    async def _reject(self, send: Send) -> None:
        await self._send_json(send, PayloadTooLarge(
            f"the request body is larger than {self.max_request_bytes} bytes"
        ))

    @staticmethod
    async def _send_json(send: Send, err) -> None:
        body = json.dumps(err.body()).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                    for k, v in err.headers.items()]
        await send({"type": "http.response.start", "status": err.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})
