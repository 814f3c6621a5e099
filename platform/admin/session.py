"""Dashboard sessions: the login form posts the admin key once; the browser then holds
only a random session id in an HTTP-only, ``SameSite=Strict`` cookie scoped to
``/admin``. Every state-changing request made with the cookie must echo the session's
CSRF token (header ``X-CSRF-Token``); requests with ``Authorization: Bearer`` need none.
Sessions live in this process (a restart logs everyone out)."""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass

COOKIE = "loramux_admin"
CSRF_HEADER = "X-CSRF-Token"
SESSION_TTL_S = 8 * 3600
MAX_SESSIONS = 1000


@dataclass(frozen=True)
class Session:
    csrf: str
    expires: float

    def csrf_ok(self, token: str | None) -> bool:
        return bool(token) and hmac.compare_digest(token.encode(), self.csrf.encode())


class Sessions:
    """Session id → :class:`Session`, bounded and expiring."""

    def __init__(self, ttl: float = SESSION_TTL_S) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._by_id: dict[str, Session] = {}

    def create(self) -> tuple[str, Session]:
        sid = secrets.token_urlsafe(32)
        session = Session(secrets.token_urlsafe(32), time.monotonic() + self.ttl)
        with self._lock:
            now = time.monotonic()
            for old in [k for k, s in self._by_id.items() if s.expires < now]:
                del self._by_id[old]
            if len(self._by_id) >= MAX_SESSIONS:
                self._by_id.pop(next(iter(self._by_id)))
            self._by_id[sid] = session
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._lock:
            session = self._by_id.get(sid)
        if session is None or session.expires < time.monotonic():
            return None
        return session

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._by_id.pop(sid or "", None)


def set_cookie(response, sid: str, *, secure: bool) -> None:
    response.set_cookie(COOKIE, sid, httponly=True, samesite="strict", path="/admin",
                        secure=secure, max_age=SESSION_TTL_S)
