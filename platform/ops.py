"""Operations routes: liveness (``/health``), readiness (``/ready``), Prometheus
(``/metrics``)."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from loramux.platform.deps import MetricsReaderDep, StateDep

router = APIRouter(tags=["operations"])


class Health(BaseModel):
    status: str
    """``ok``, or what is wrong."""


class Readiness(BaseModel):
    status: str
    """``ready`` or ``not ready``."""
    checks: dict[str, bool]
    """Each part asked (engine, registry) and whether it answered."""


@router.get("/health", response_model=Health)
async def health(state: StateDep):
    """200 while the engine loop runs."""
    if not state.engine.is_running:
        return JSONResponse(Health(status="engine stopped").model_dump(), status_code=503)
    return Health(status="ok")


@router.get("/ready", response_model=Readiness)
async def ready(state: StateDep):
    """200 when requests can be served: the engine runs and the registry answers."""
    checks = {"engine": state.engine.is_running}
    if state.registry is not None:
        try:
            await run_in_threadpool(state.registry.list_tenants)
            checks["registry"] = True
        except Exception:
            checks["registry"] = False
    ok = all(checks.values())
    body = Readiness(status="ready" if ok else "not ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get("/metrics")
async def metrics(state: StateDep, reader: MetricsReaderDep):
    """Prometheus text format; needs the admin key unless the server runs with
    ``--metrics-public``."""
    snapshot = None
    if state.engine.is_running:
        with contextlib.suppress(Exception):
            snapshot = await state.engine.lora_snapshot()
    state.metrics.update_engine(state.engine.stats(), snapshot)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
