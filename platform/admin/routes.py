"""The admin JSON API (admin key as a Bearer token, or a dashboard session + CSRF token).
The dashboard pages (:mod:`loramux.platform.admin.pages`) and ``loramux admin`` use it."""

from __future__ import annotations

from fastapi import APIRouter, Query

from loramux.platform.admin.schemas import (
    ActionResult,
    AuditLog,
    Overview,
    ReleaseRow,
    Releases,
    Residency,
    TenantList,
)
from loramux.platform.deps import AdminDep, AdminServiceDep
from loramux.platform.openai.protocol import ERROR_RESPONSES

router = APIRouter(prefix="/admin", tags=["admin"], responses=ERROR_RESPONSES)


@router.get("/overview", response_model=Overview)
async def overview(_: AdminDep, service: AdminServiceDep):
    """The base model and every engine's numbers (slots, CPU tier, KV cache, queue, tokens/s)."""
    return await service.overview()


@router.get("/adapters", response_model=Residency)
async def residency(_: AdminDep, service: AdminServiceDep):
    """Every adapter per engine: tier (gpu | device | cpu | disk | store), slot, pinned,
    in use, pending eviction, load time, in-flight requests, last-minute requests and tokens."""
    return await service.adapters()


@router.get("/tenants", response_model=TenantList)
async def tenants(_: AdminDep, service: AdminServiceDep):
    """Every tenant: usage against each quota, recent 429s, API keys (never the key)."""
    return await service.tenants()


@router.get("/events", response_model=AuditLog)
async def events(_: AdminDep, service: AdminServiceDep, tenant: str | None = None,
                 kind: str | None = None, limit: int = Query(200, ge=1, le=1000)):
    """Recent adapter and key events, newest first (filter by tenant name and kind)."""
    return await service.audit(tenant, kind, limit)


@router.get("/releases", response_model=Releases)
async def releases(_: AdminDep, service: AdminServiceDep):
    """Every tenant adapter: its versions, the live split, the rollback target, and each
    version's numbers over the last hour (requests, errors, tokens, TTFT / TPOT)."""
    return await service.releases()


@router.post("/releases/{tenant}/{adapter}/rollback", response_model=ReleaseRow)
async def rollback(tenant: str, adapter: str, _: AdminDep, service: AdminServiceDep):
    """Put 100% on the adapter's previous live version (409 when there is none)."""
    return await service.rollback(tenant, adapter)


@router.post("/adapters/{key:path}/{action}", response_model=ActionResult)
async def act(key: str, action: str, _: AdminDep, service: AdminServiceDep,
              engine: str | None = Query(None, description="one engine's id; default: every engine")):
    """``evict``: free the adapter's device slot now, or once no running request uses it
    (``deferred`` says so). ``pin``: keep it resident (loads it if needed); ``unpin`` undoes
    that. ``warm``: load it into CPU memory and, when a slot is free or evictable, a device slot."""
    return await service.act(key, action, engine)
