"""``GET /v1/quotas``: a tenant's quotas in effect and what it uses of them."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel, Field

from loramux.platform.deps import StateDep, TenantDep
from loramux.platform.errors import ServiceUnavailable
from loramux.platform.openai.protocol import ERROR_RESPONSES

router = APIRouter(prefix="/v1", tags=["tenant"], responses=ERROR_RESPONSES)


class QuotaValues(BaseModel):
    """The quotas in effect (null = unlimited); fields as in ``loramux tenants quota``."""

    max_concurrent_requests: int | None
    max_queued_sequences: int | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_adapters: int | None
    max_stored_bytes: int | None
    max_embedding_copy_bytes: int | None = Field(
        None, description="Bytes of one adapter's embedding / lm_head rows that differ from the base.")
    ttft_objective_ms: int | None = Field(None, description="Your time-to-first-token objective "
                                          "in the engine's goodput count (null: the server's).")
    itl_objective_ms: int | None = Field(None, description="Your mean inter-token objective in "
                                         "the engine's goodput count (null: the server's).")


class StorageUsage(BaseModel):
    """What the tenant stores now."""

    adapters: int
    stored_bytes: int


class TenantQuotas(BaseModel):
    object: Literal["tenant.quotas"] = "tenant.quotas"
    tenant: str = Field(description="The tenant's name.")
    quotas: QuotaValues
    usage: StorageUsage


@router.get("/quotas", response_model=TenantQuotas)
async def get_quotas(caller: TenantDep, state: StateDep):
    """The caller's quotas (its own, else the server's defaults) and its storage usage.
    Over a request limit the API answers 429 with ``Retry-After``."""
    if state.registry is None:
        raise ServiceUnavailable("this server runs without an adapter registry", code="no_registry")
    quotas = await state.deps.db.call(state.registry.get_quotas, caller.tenant.id)
    usage = await state.deps.db.call(state.registry.get_usage, caller.tenant.id)
    return TenantQuotas(tenant=caller.tenant.name, quotas=QuotaValues(**quotas.to_dict()),
                        usage=StorageUsage(adapters=usage.adapters, stored_bytes=usage.stored_bytes))
