"""FastAPI dependencies as ``Annotated`` aliases (the full-stack template's style).

``CallerDep`` is whoever sent an inference request (a tenant, or anonymous where
allowed); ``TenantDep`` requires a tenant key; ``AdminDep`` the admin key.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loramux.platform.adapter_api.service import AdapterService
from loramux.platform.admin.service import AdminService
from loramux.platform.admin.session import COOKIE, CSRF_HEADER
from loramux.platform.errors import Forbidden, ServiceUnavailable, Unauthorized
from loramux.platform.identity import Caller
from loramux.platform.openai.responses_api.service import ResponsesService
from loramux.platform.openai.serving import OpenAIServing
from loramux.platform.server import AdminState, app_of
from loramux.platform.state import AppState

_bearer = HTTPBearer(auto_error=False, description="A tenant API key (`lmx_...`) or the admin key.")


async def get_state(request: Request) -> AppState:
    """Every service of the server (503 while the lifespan is still building them)."""
    state = app_of(request).services
    if state is None:
        raise ServiceUnavailable("the server is starting", code="not_ready")
    return state


async def get_admin_state(request: Request) -> AdminState:
    """What the admin routers read (the server's services, or a gateway's)."""
    state = app_of(request).admin_state
    if state is None:
        raise ServiceUnavailable("the server is starting", code="not_ready")
    return state


StateDep = Annotated[AppState, Depends(get_state)]
AdminStateDep = Annotated[AdminState, Depends(get_admin_state)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _header(creds: HTTPAuthorizationCredentials | None) -> str | None:
    return f"Bearer {creds.credentials}" if creds is not None else None


async def get_caller(request: Request, state: StateDep, creds: Credentials) -> Caller:
    caller = await state.auth.caller(_header(creds))
    request.state.caller = caller  # who a 429 went to (app.record_rejection)
    return caller


async def get_tenant(state: StateDep, creds: Credentials) -> Caller:
    return await state.auth.tenant(_header(creds))


async def get_admin(request: Request, state: AdminStateDep, creds: Credentials) -> Caller:
    """The admin key as a Bearer token, or a dashboard session cookie (whose requests
    other than GET must carry the session's CSRF token)."""
    if creds is not None:
        return await state.auth.admin(_header(creds))
    session = state.admin_sessions.get(request.cookies.get(COOKIE))
    if session is None:
        raise Unauthorized("the admin key is required", headers={"WWW-Authenticate": "Bearer"})
    if request.method not in ("GET", "HEAD") and not session.csrf_ok(
        request.headers.get(CSRF_HEADER)
    ):
        raise Forbidden(f"missing or wrong CSRF token (header {CSRF_HEADER})", code="csrf_failed")
    return Caller(None, is_admin=True)


async def get_metrics_reader(state: AdminStateDep, creds: Credentials) -> Caller | None:
    """/metrics names every tenant's adapters: the admin key, unless ``--metrics-public``."""
    if state.settings.metrics_public:
        return None
    return await state.auth.admin(_header(creds))


CallerDep = Annotated[Caller, Depends(get_caller)]
TenantDep = Annotated[Caller, Depends(get_tenant)]
AdminDep = Annotated[Caller, Depends(get_admin)]
MetricsReaderDep = Annotated[Caller | None, Depends(get_metrics_reader)]


async def get_openai(state: StateDep) -> OpenAIServing:
    return state.openai


async def get_responses(state: StateDep) -> ResponsesService:
    """The Responses API service (``/v1/responses``)."""
    if state.responses is None:
        raise ServiceUnavailable("the server is starting", code="not_ready")
    return state.responses


async def get_adapter_service(state: StateDep) -> AdapterService:
    if state.adapters is None:
        raise ServiceUnavailable("this server runs without an adapter registry", code="no_registry")
    return state.adapters


async def get_admin_service(state: AdminStateDep) -> AdminService:
    return state.admin


OpenAIDep = Annotated[OpenAIServing, Depends(get_openai)]
ResponsesDep = Annotated[ResponsesService, Depends(get_responses)]
AdaptersDep = Annotated[AdapterService, Depends(get_adapter_service)]
AdminServiceDep = Annotated[AdminService, Depends(get_admin_service)]
