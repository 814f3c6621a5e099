"""Admin dashboard (``GET /admin``, a static page) and its JSON API (admin key)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from loramux.platform.admin.page import ADMIN_PAGE
from loramux.platform.admin.schemas import ActionResult, Residency
from loramux.platform.deps import AdminDep, AdminServiceDep
from loramux.platform.openai.protocol import ERROR_RESPONSES

router = APIRouter(prefix="/admin", tags=["admin"], responses=ERROR_RESPONSES)


@router.get("", response_class=HTMLResponse, include_in_schema=False)
async def dashboard():
    """The dashboard page; it asks for the admin key and sends it as a Bearer token."""
    return HTMLResponse(ADMIN_PAGE, headers={"Cache-Control": "no-store"})


@router.get("/adapters", response_model=Residency)
async def residency(_: AdminDep, service: AdminServiceDep):
    """Every adapter: tier (gpu | device | cpu | disk | store), slot, pinned, in use, load time."""
    return await service.adapters()


@router.post("/adapters/{key:path}/{action}", response_model=ActionResult)
async def act(key: str, action: str, _: AdminDep, service: AdminServiceDep):
    """``evict``: free the adapter's device slot (now, or once no running request uses it).
    ``pin``: keep it resident (loads it if needed); ``unpin`` undoes that. ``warm``: load it
    into CPU memory and, when a slot is free or evictable, a device slot."""
    return await service.act(key, action)
