"""Operator view of adapter residency and the evict / pin / unpin / warm actions.

Rows are keyed by the engine key (``"<tenant id>/<name>@<digest>"``). Registry
adapters this engine has not loaded yet show up with tier ``store``; acting on one
registers it with the engine first. Slot state is read from the snapshot the engine
publishes (``AsyncEngine.lora_snapshot``), and every ``LoRAManager`` call runs on the
engine thread through ``AsyncEngine.call``; ``warm`` and ``pin`` wait for the
background load here, on the event loop, never on the engine thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from loramux.engine.async_engine import AsyncEngine
from loramux.platform.admin.schemas import ActionResult, EngineSummary, Residency, ResidencyRow
from loramux.platform.errors import BadRequest, NotFound, ServiceUnavailable, Unprocessable
from loramux.platform.openai.resolver import ModelResolver, engine_key

if TYPE_CHECKING:
    from loramux.engine.lora.manager import ResidencySnapshot
    from loramux.registry.service import AdapterHandle, RegistryService

logger = logging.getLogger(__name__)

ACTIONS = ("evict", "pin", "unpin", "warm")
WARM_TIMEOUT_S = 120.0
"""How long ``warm`` / ``pin`` wait for an adapter's background load."""


class AdminService:
    """The admin API's logic over one engine and (optionally) the registry."""

    def __init__(self, engine: AsyncEngine, registry: RegistryService | None,
                 resolver: ModelResolver) -> None:
        self.engine = engine
        self.registry = registry
        self.resolver = resolver

    async def snapshot(self) -> ResidencySnapshot:
        if not self.engine.is_running:
            raise ServiceUnavailable("the engine is not running", code="engine_dead")
        return await self.engine.lora_snapshot()

    def _registry_rows(self) -> list[tuple[str, AdapterHandle, str]]:
        if self.registry is None:
            return []
        tenants = {t.id: t.name for t in self.registry.list_tenants()}
        return [
            (engine_key(h.tenant_id, h.name, h.cache_key), h, tenants.get(h.tenant_id, "?"))
            for h in self.registry.list_all()
        ]

    async def adapters(self) -> Residency:
        """Every adapter the engine knows or the registry holds, with its residency."""
        snap = await self.snapshot()
        rows = {r["name"]: ResidencyRow(key=r["name"], **r) for r in snap.rows}
        for name, served in self.resolver.static.items():
            key = served.lora.lora_name
            row = rows.setdefault(key, ResidencyRow(key=key, name=key, tier="store"))
            row.tenant, row.adapter, row.source = None, name, "static"
        for key, handle, tenant in await run_in_threadpool(self._registry_rows):
            row = rows.setdefault(key, ResidencyRow(key=key, name=key, tier="store"))
            row.tenant, row.adapter, row.source = tenant, handle.name, "registry"
            row.version, row.size_bytes = handle.version, handle.size_bytes
        stats = self.engine.stats()
        return Residency(
            data=sorted(rows.values(), key=lambda r: (r.tier == "store", r.key)),
            engine=EngineSummary(
                running=stats.num_running, waiting=stats.num_waiting,
                kv_cache_usage=stats.kv_cache_usage, num_preemptions=stats.num_preemptions,
                max_loras=snap.max_loras, evictions=snap.num_evictions,
                lora_enabled=snap.lora_enabled,
            ),
        )

    async def act(self, key: str, action: str) -> ActionResult:
        if action not in ACTIONS:
            raise NotFound(f"unknown action {action!r}; use one of {', '.join(ACTIONS)}")
        snap = await self.snapshot()
        if not snap.lora_enabled:
            raise BadRequest("this server was started without LoRA")
        mgr = self.engine.engine.lora_manager
        handle = None
        if not snap.knows(key):
            request, handle = await self._lora_request(key)
            if action in ("evict", "unpin"):
                return ActionResult(key=key, action=action, done=False, detail="not loaded")
            await self.engine.call(lambda: mgr.register(request))
        fn = {"evict": mgr.evict, "pin": mgr.pin, "unpin": mgr.unpin, "warm": mgr.warm}[action]
        try:
            result = await self.engine.call(lambda: fn(key))
            if action in ("pin", "warm"):
                resident = await self._until_resident(key)
                result = resident if action == "warm" else result
        except ValueError as e:  # LoRAError, AdapterValidationError
            raise Unprocessable(str(e), param="name") from None
        if action == "evict" and self.registry is not None:
            await self._record_evict(key, handle)
        logger.info("admin %s %s", action, key, extra={"adapter": key, "action": action})
        return ActionResult(key=key, action=action, done=result is not False)

    async def _until_resident(self, key: str) -> bool:
        """Ask the engine (one short call each) until the adapter's background load landed
        and it sits in a device slot; False when no slot came free in time."""
        mgr = self.engine.engine.lora_manager
        deadline = time.monotonic() + WARM_TIMEOUT_S
        while True:
            if await self.engine.call(lambda: mgr.warm(key)):
                return True
            if not await self.engine.call(lambda: key in mgr.loading):
                return False  # in CPU memory, but every slot is busy or pinned
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)

    async def _lora_request(self, key: str):
        for served in self.resolver.static.values():
            if served.lora.lora_name == key:
                return served.lora, None
        for k, handle, _ in await run_in_threadpool(self._registry_rows):
            if k == key:
                path = await run_in_threadpool(handle.local_path)
                served = self.resolver.served_from_handle(handle, path)
                return served.lora, handle
        raise NotFound(f"adapter {key!r} not found", code="adapter_not_found")

    async def _record_evict(self, key: str, handle: AdapterHandle | None) -> None:
        try:
            if handle is None:
                for k, h, _ in await run_in_threadpool(self._registry_rows):
                    if k == key:
                        handle = h
                        break
            if handle is not None:
                await run_in_threadpool(
                    self.registry.record_event, handle.id, "evicted", actor="admin"
                )
        except Exception:
            logger.exception("could not record the eviction of %s", key)
