"""Operations routes: liveness (``/health``), readiness (``/ready``), Prometheus
(``/metrics``).

``/ready`` asks every dependency the server has (the database, the object store, Redis)
through its bulkhead with a short deadline, so a stalled one answers "down" in about a
second instead of hanging the probe. A failing dependency makes the server ``degraded``
(200: base-model requests and cached callers are still served, and every replica shares
the dependency, so leaving the rotation would not help); a stopped engine or a draining
server is ``not ready`` (503). An engine whose compiled CPU kernels are missing is
``degraded`` too (``"kernels": "degraded"``: it serves, on the slower torch path). Why a
dependency is down or the kernels are missing (which may name a host or a path) is shown to
the admin key only.
"""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from loramux.platform.auth import bearer_key
from loramux.platform.deps import MetricsReaderDep, StateDep
from loramux.platform.server import app_of
from loramux.platform.state import AppState

router = APIRouter(tags=["operations"])

class Health(BaseModel):
    status: str
    """``ok``, or what is wrong."""


class Readiness(BaseModel):
    status: str
    """``ready``, ``degraded`` (a dependency fails; still serving) or ``not ready``."""
    checks: dict[str, bool]
    """Each part asked and whether it answered."""
    dependencies: dict[str, str] = {}
    """``ok`` / ``degraded`` / ``down`` per dependency (database, object store, redis)."""
    kernels: str = "ok"
    """The engine's compiled CPU kernels: ``ok``, ``disabled`` (turned off by the operator) or
    ``degraded`` (missing: the engine runs on torch ops)."""
    reasons: dict[str, str] | None = None
    """Why each failing dependency failed, and why the kernels are not ok: only with the admin
    key."""


@router.get("/health", response_model=Health)
async def health(state: StateDep):
    """200 while the engine loop runs."""
    if not state.engine.is_ready:
        return JSONResponse(Health(status="engine stopped").model_dump(), status_code=503)
    return Health(status="ok")


async def _is_admin(state: AppState, request: Request) -> bool:
    key = bearer_key(request.headers.get("authorization"))
    if key is None:
        return False
    with contextlib.suppress(Exception):
        caller = await state.auth.lookup(key)
        return bool(caller is not None and caller.is_admin)
    return False


@router.get("/ready", response_model=Readiness)
async def ready(state: StateDep, request: Request):
    """200 ``ready`` or ``degraded`` while requests can be served; 503 ``not ready`` when
    the engine is stopped or the server is draining for shutdown."""
    drain = app_of(request).drain
    checks = {"engine": state.engine.is_ready,
              "accepting": not (drain is not None and drain.draining)}
    deps, reasons = await state.dependency_report()
    if "database" in deps:
        checks["registry"] = deps["database"] != "down"
    stats = state.engine.stats()
    if stats.cpu_kernels_reason is not None:
        reasons = {**reasons, "kernels": stats.cpu_kernels_reason}
    serving = checks["engine"] and checks["accepting"]
    status = "not ready" if not serving else (
        "ready" if all(s == "ok" for s in deps.values()) and stats.cpu_kernels != "degraded"
        else "degraded")
    body = Readiness(status=status, checks=checks, dependencies=deps, kernels=stats.cpu_kernels,
                     reasons=reasons if await _is_admin(state, request) else None)
    return JSONResponse(body.model_dump(), status_code=200 if serving else 503)


@router.get("/metrics")
async def metrics(state: StateDep, reader: MetricsReaderDep):
    """Prometheus text format; needs the admin key unless the server runs with
    ``--metrics-public``."""
    snapshot = None
    if state.engine.is_ready:
        with contextlib.suppress(Exception):
            snapshot = await state.engine.lora_snapshot()
    state.metrics.update_engine(state.engine.stats(), snapshot)
    if state.kv_events is not None:
        state.metrics.kv_events_published.set(state.kv_events.published)
        state.metrics.kv_events_dropped.set(state.kv_events.dropped)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
