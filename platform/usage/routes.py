"""``GET /v1/usage`` (the caller's tenant) and ``GET /admin/usage`` (every tenant; CSV with
``Accept: text/csv``): usage sums of finished requests over a time range, grouped."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from loramux.platform.deps import AdminDep, StateDep, TenantDep
from loramux.platform.errors import ServiceUnavailable
from loramux.platform.openai.protocol import ERROR_RESPONSES
from loramux.platform.usage.service import UsageQuery, UsageService, columns, to_csv
from loramux.registry.usage import GROUP_KEYS

router = APIRouter(tags=["usage"], responses=ERROR_RESPONSES)

_START = Query(None, description="Unix seconds or ISO 8601 (UTC without a zone); default: "
               "the oldest record kept.")
_END = Query(None, description="Exclusive; unix seconds or ISO 8601; default: now.")
_GROUP = Query([], description="adapter, version (implies adapter), day (UTC), key (the API "
               "key's prefix); repeated or comma-separated.")
_LIMIT = Query(1000, description="Most groups returned (1..10000); has_more says there are more.")


class UsageRow(BaseModel):
    """One group: the keys asked for (``version`` brings ``adapter``; ``adapter`` null is
    the base model), then the sums."""

    model_config = ConfigDict(extra="allow")

    tenant: str | None = None
    adapter: str | None = None
    version: int | None = None
    day: str | None = None
    key: str | None = None
    requests: int
    errors: int
    """Requests that ended with an error (or were cancelled)."""
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_tokens: int


class UsageList(BaseModel):
    object: Literal["list"] = "list"
    data: list[UsageRow]
    has_more: bool = False


def _service(state) -> UsageService:
    if state.registry is None:
        raise ServiceUnavailable("this server runs without an adapter registry", code="no_registry")
    return UsageService(state.registry, state.deps,
                        state.usage.flush if state.usage is not None else None)


@router.get("/v1/usage", response_model=UsageList, response_model_exclude_unset=True)
async def tenant_usage(caller: TenantDep, state: StateDep, start: str | None = _START,
                       end: str | None = _END, group_by: list[str] = _GROUP,
                       limit: int = _LIMIT):
    """The caller's tenant's requests and tokens (prompt, cached, completion) in ``[start,
    end)``: one row per group; without ``group_by`` one row of totals. The sums equal the
    ``usage`` objects the responses carried."""
    q = UsageQuery.parse(start, end, group_by, limit,
                         [k for k in GROUP_KEYS if k != "tenant"])
    return await _service(state).tenant(caller.tenant.id, q)


@router.get("/admin/usage", response_model=UsageList, response_model_exclude_unset=True,
            responses={200: {"content": {"text/csv": {}}}})
async def admin_usage(request: Request, _: AdminDep, state: StateDep, start: str | None = _START,
                      end: str | None = _END, group_by: list[str] = _GROUP,
                      limit: int = _LIMIT, tenant: str | None = None):
    """Every tenant's usage (``group_by`` may also name ``tenant``: the default), or one
    tenant's (``tenant``, by name); CSV with ``Accept: text/csv``."""
    q = UsageQuery.parse(start, end, group_by or ["tenant"], limit, GROUP_KEYS)
    body = await _service(state).all_tenants(q, tenant)
    if "text/csv" in request.headers.get("accept", ""):
        return Response(to_csv(body["data"], columns(q, admin=True)), media_type="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="usage.csv"'})
    return body
