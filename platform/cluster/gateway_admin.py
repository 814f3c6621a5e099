"""The admin dashboard and JSON API served at a gateway, over every engine in the cluster.

The same routers as the all-in-one server (:mod:`loramux.platform.admin.routes` and
``pages``: admin key, session and CSRF rules unchanged) read the app's ``admin_state``
(:class:`~loramux.platform.server.AdminState`); a gateway sets it to a
:class:`GatewayAdminState` whose admin service runs on a :class:`ClusterFleet` and the
gateway's registry.

:class:`ClusterFleet` is the gateway's :class:`~loramux.platform.admin.fleet.Fleet`: every
engine from its Redis heartbeat record, and each action published to one engine (by id) or
to all, answered by each acting engine through a Redis reply list."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from loramux.adapters.arch import folder_family
from loramux.platform.admin.activity import Activity
from loramux.platform.admin.fleet import FleetEngine, Outcome
from loramux.platform.admin.schemas import EngineSummary
from loramux.platform.admin.service import AdminService
from loramux.platform.admin.session import Sessions
from loramux.platform.auth import Authenticator
from loramux.platform.cluster.gateway import Gateway
from loramux.platform.cluster.protocol import ClusterEvent, EngineRecord
from loramux.platform.cluster.redis_state import ClusterState
from loramux.platform.errors import NotFound, ServiceUnavailable, Unprocessable
from loramux.platform.openai.resolver import ModelResolver
from loramux.platform.probes import dependency_report
from loramux.platform.settings import Settings

if TYPE_CHECKING:
    from loramux.engine.lora_request import LoRARequest


ACTION_TIMEOUT_S = 35.0
"""How long an action waits for the engines' replies (engines give up on theirs at 30 s)."""


def engine_view(rec: EngineRecord) -> FleetEngine:
    """One engine's dashboard view from its heartbeat record (GPU and CPU residency)."""
    rows = [{"name": k, "tier": "gpu"} for k in sorted(rec.resident)]
    rows += [{"name": k, "tier": "cpu"} for k in sorted(rec.cpu_resident - rec.resident)]
    return FleetEngine(EngineSummary.of(rec), rows)


class ClusterFleet:
    """The engines registered in one Redis namespace (``--role gateway``)."""

    def __init__(self, cluster: ClusterState, *, origin: str,
                 timeout: float = ACTION_TIMEOUT_S) -> None:
        self.cluster = cluster
        self.origin = origin
        self.timeout = timeout

    async def _records(self) -> list[EngineRecord]:
        try:
            return await run_in_threadpool(self.cluster.read_engines)
        except Exception as e:
            raise ServiceUnavailable(f"cannot read the engines from Redis: {e}",
                                     code="engine_dead") from None

    async def engines(self) -> list[FleetEngine]:
        records = await self._records()
        if not records:
            raise ServiceUnavailable("no engine is registered", code="engine_dead")
        return [engine_view(r) for r in records]

    def knows(self, view: FleetEngine, key: str) -> bool:
        """Always: each engine resolves the key through the shared registry itself."""
        return True

    async def act(self, engine_id: str | None, action: str, key: str,
                  request: LoRARequest | None) -> list[Outcome]:
        ids = [r.engine_id for r in await self._records()]
        if engine_id:
            if engine_id not in ids:
                raise NotFound(f"no engine {engine_id!r}; live: {', '.join(ids) or 'none'}",
                               code="engine_not_found")
            ids = [engine_id]
        reply_to = f"{self.cluster.namespace}:reply:{uuid.uuid4().hex}"
        ev = ClusterEvent(action, adapter_id=key, origin=self.origin,
                          target=engine_id or None, reply_to=reply_to)
        try:
            await run_in_threadpool(self.cluster.publish_event, ev)
            replies = await run_in_threadpool(self.cluster.wait_replies, reply_to, len(ids),
                                              self.timeout)
        except Exception as e:
            raise ServiceUnavailable(f"cannot reach Redis to send {action}: {e}") from None
        got = {r.engine_id: r for r in replies}
        errors = [f"{r.engine_id}: {r.error}" for r in replies if r.error]
        if errors and len(errors) == len(ids):
            raise Unprocessable("; ".join(errors), param="key", code="action_failed")
        return [Outcome(i, got[i].done, got[i].deferred) if i in got else Outcome(i, False)
                for i in ids]


@dataclass
class GatewayAdminState:
    """What the admin routers' dependencies read (``auth``, ``admin``, ``admin_sessions``,
    ``settings``) at a gateway."""

    settings: Settings
    auth: Authenticator
    admin: AdminService
    admin_sessions: Sessions = field(default_factory=Sessions)


def gateway_admin_state(gw: Gateway, settings: Settings) -> GatewayAdminState:
    """The dashboard's state at a gateway: every registered engine, the shared registry."""
    fleet = ClusterFleet(gw.cluster, origin=gw.gateway_id)
    base = settings.model or ""  # a gateway may run without --model (engines load it);
    # the resolver only lists static adapters here (none at a gateway)
    resolver = ModelResolver([base or "base"], registry=gw.registry,
                             ttl=settings.model_cache_ttl, deps=gw.deps,
                             base_family=folder_family(base) if base else None)
    admin = AdminService(fleet, gw.registry, resolver, Activity(), base_model=base,
                         dtype=settings.dtype, device=settings.device,
                         base_family=resolver.base_family)
    admin.health = functools.partial(dependency_report, gw.deps, gw.registry,
                                     [gw.limiter.backend] if gw.limiter is not None else [])
    return GatewayAdminState(settings, gw.auth, admin)
