"""The dashboard's server-rendered pages (Jinja2, plain CSS, a little JavaScript that
refreshes the page body and posts the actions to the JSON API with the CSRF token).

``/admin/login`` takes the admin key once (a form POST: never in a URL) and starts a
session (:mod:`loramux.platform.admin.session`); the pages need that session and send
the browser back to the login form without one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Form, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from loramux.platform.admin.actions import ACTIONS
from loramux.platform.admin.schemas import ResidencyRow
from loramux.platform.admin.session import COOKIE, Session, set_cookie
from loramux.platform.deps import AdminDep, AdminServiceDep, AdminStateDep
from loramux.platform.errors import APIError, NotFound

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(prefix="/admin", include_in_schema=False)
STATIC = {"admin.css": "text/css", "admin.js": "text/javascript"}
SORTS = {
    "key": lambda r: r.key, "tenant": lambda r: r.tenant or "", "tier": lambda r: r.tier,
    "rank": lambda r: r.rank or 0, "size": lambda r: r.size_bytes or 0,
    "in_flight": lambda r: r.in_flight, "requests": lambda r: r.requests_1m,
    "tokens": lambda r: r.tokens_1m, "last_used": lambda r: r.last_used.timestamp() if r.last_used else 0,
}
NO_STORE = {"Cache-Control": "no-store"}


def sparkline(points: list[float], width: int = 120, height: int = 22) -> str:
    """An inline SVG polyline of ``points`` (the template marks it safe: numbers only)."""
    top = max(points, default=0) or 1.0
    step = width / max(len(points) - 1, 1)
    coords = " ".join(
        f"{i * step:.1f},{height - 1 - (height - 2) * p / top:.1f}" for i, p in enumerate(points)
    )
    return (f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}">'
            f'<polyline fill="none" stroke="currentColor" stroke-width="1.5" points="{coords}"/></svg>')


templates.env.globals["sparkline"] = sparkline
templates.env.globals["ADMIN_ACTIONS"] = ACTIONS


async def page_session(request: Request, state: AdminStateDep) -> Session:
    """The dashboard session; without one the browser goes to the login form (303)."""
    session = state.admin_sessions.get(request.cookies.get(COOKIE))
    if session is None:
        raise HTTPException(303, "log in first", headers={"Location": "/admin/login"})
    return session


PageSession = Annotated[Session, Depends(page_session)]


def _render(request: Request, session: Session, name: str, **context) -> Response:
    return templates.TemplateResponse(
        request, name, {"csrf": session.csrf, "page": name.removesuffix(".html"), **context},
        headers=NO_STORE,
    )


@router.get("/login", response_class=HTMLResponse)
async def login_form(request: Request):
    return templates.TemplateResponse(request, "login.html", {"error": None}, headers=NO_STORE)


@router.post("/login")
async def login(request: Request, state: AdminStateDep, key: Annotated[str, Form()]):
    """Check the admin key and start a session; the key itself is never stored."""
    try:
        await state.auth.admin(f"Bearer {key}")
    except APIError as e:
        return templates.TemplateResponse(request, "login.html", {"error": e.message},
                                          status_code=e.status_code, headers=NO_STORE)
    sid, _ = state.admin_sessions.create()
    response = RedirectResponse("/admin", status_code=303)
    set_cookie(response, sid, secure=request.url.scheme == "https")
    return response


@router.post("/logout")
async def logout(request: Request, state: AdminStateDep, _: AdminDep):
    """End the session (a CSRF-checked POST like every other)."""
    state.admin_sessions.drop(request.cookies.get(COOKIE))
    response = Response(status_code=204)
    response.delete_cookie(COOKIE, path="/admin")
    return response


@router.get("/static/{name}")
async def static(name: str):
    if name not in STATIC:
        raise NotFound(f"no static file {name!r}")
    return FileResponse(HERE / "static" / name, media_type=STATIC[name])


@router.get("", response_class=HTMLResponse)
async def overview_page(request: Request, session: PageSession, service: AdminServiceDep):
    return _render(request, session, "overview.html", overview=await service.overview())


@router.get("/ui/adapters", response_class=HTMLResponse)
async def adapters_page(request: Request, session: PageSession, service: AdminServiceDep,
                        tenant: str = "", tier: str = "", sort: str = "key", desc: bool = False):
    data = await service.adapters()
    rows: list[ResidencyRow] = data.data
    tenants = sorted({r.tenant for r in rows if r.tenant})
    tiers = sorted({r.tier for r in rows})
    if tenant:
        rows = [r for r in rows if r.tenant == tenant]
    if tier:
        rows = [r for r in rows if r.tier == tier]
    rows = sorted(rows, key=SORTS.get(sort, SORTS["key"]), reverse=desc)
    engines = [e.id for e in (await service.overview()).engines]
    releases = (await service.releases()).data
    if tenant:
        releases = [r for r in releases if r.tenant == tenant]
    return _render(request, session, "adapters.html", rows=rows, tenants=tenants, tiers=tiers,
                   tenant=tenant, tier=tier, sort=sort, desc=desc, engines=engines,
                   releases=releases)


@router.get("/ui/tenants", response_class=HTMLResponse)
async def tenants_page(request: Request, session: PageSession, service: AdminServiceDep):
    return _render(request, session, "tenants.html", tenants=(await service.tenants()).data)


@router.get("/ui/audit", response_class=HTMLResponse)
async def audit_page(request: Request, session: PageSession, service: AdminServiceDep,
                     tenant: str = "", kind: str = ""):
    log = await service.audit(tenant, kind)
    return _render(request, session, "audit.html", events=log.data, tenant=tenant, kind=kind)
