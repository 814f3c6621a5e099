"""Which model a request's ``model`` field names: the base model, a static adapter
(``--lora-modules``) or one of the caller's tenant adapters (registry, cached).

Engine adapter keys (:class:`~loramux.platform.identity.EngineKey`) are unique across
tenants and versions, so a replaced adapter never serves stale weights;
:meth:`ModelResolver.on_registry_event` drops superseded keys from the engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loramux.engine.lora_request import LoRARequest
from loramux.platform.bulkheads import Dependencies
from loramux.platform.errors import ModelNotFound
from loramux.platform.identity import STATIC_OWNER, Caller, EngineKey
from loramux.platform.settings import setting_default
from loramux.platform.ttl_cache import TTLCache

if TYPE_CHECKING:
    from loramux.registry.handles import AdapterHandle
    from loramux.registry.service import RegistryService

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """What a ``model`` name resolves to."""

    name: str
    lora: LoRARequest | None
    """None = the base model."""
    preset: dict[str, Any] = field(default_factory=dict)
    owned_by: str = "loramux"
    created: int = 0
    adapter_id: int | None = None
    """Registry id of a tenant adapter."""

    @property
    def label(self) -> str:
        """Metrics label: the engine key, or ``base``."""
        return self.lora.lora_name if self.lora is not None else "base"


def _int_id(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) + 1


def folder_digest(path: Path) -> str:
    """sha256 over an adapter folder's config and weights (static adapters)."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        p = path / name
        if p.is_file():
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def parse_lora_modules(specs: list[str]) -> dict[str, Path]:
    """``name=path`` or ``{"name": .., "path": ..}`` items of ``--lora-modules``."""
    out: dict[str, Path] = {}
    for spec in specs:
        spec = spec.strip()
        if spec.startswith("{"):
            d = json.loads(spec)
            name, path = d["name"], d["path"]
        elif "=" in spec:
            name, path = spec.split("=", 1)
        else:
            raise ValueError(f"--lora-modules entry {spec!r} is not name=path")
        path = Path(path).expanduser()
        if not path.is_dir():
            raise ValueError(f"--lora-modules {name}: {path} is not a folder")
        out[name.strip()] = path
    return out


class ModelResolver:
    """Resolves ``model`` names per caller; lists what a caller may use."""

    def __init__(
        self,
        base_names: list[str],
        *,
        static_modules: dict[str, Path] | None = None,
        registry: RegistryService | None = None,
        lora_enabled: bool = True,
        ttl: float = setting_default("model_cache_ttl"),
        drop_engine_key: Callable[[str], None] | None = None,
        deps: Dependencies | None = None,
        base_family: str | None = None,
    ) -> None:
        """``deps``: registry lookups run in the database bulkhead, adapter fetches in the
        store's; a resolution seen before serves on (``outage_staleness``) while they fail.
        ``base_family``: the base model's family, shown on every model card."""
        if not base_names:
            raise ValueError("the base model needs at least one name")
        self.base_names = list(base_names)
        self.created = int(time.time())
        self.registry = registry
        self.lora_enabled = lora_enabled
        self.ttl = ttl
        self.drop_engine_key = drop_engine_key
        self.base = ServedModel(self.base_names[0], None, {}, "loramux", self.created)
        self.base_family = base_family
        self.static: dict[str, ServedModel] = {}
        for name, path in (static_modules or {}).items():
            key = str(EngineKey.of(STATIC_OWNER, name, folder_digest(path)))
            self.static[name] = ServedModel(
                name, LoRARequest(key, _int_id(key), str(path)), {}, "loramux", self.created
            )
        self.deps = deps or Dependencies()
        self._cache: TTLCache[tuple[int, str], ServedModel] = self.deps.stale_cache(
            ttl, cache_none=False)
        self._keys: dict[int, str] = {}  # adapter id -> engine key in use
        self._lock = threading.Lock()

    def adapter_id_of(self, key: str) -> int | None:
        """The registry id of the adapter version served under engine key ``key`` (None
        when no resolution in use has it, e.g. a static ``--lora-modules`` adapter)."""
        with self._lock:
            return next((aid for aid, k in self._keys.items() if k == key), None)

    # --- resolution ----------------------------------------------------------------
    async def resolve(self, caller: Caller, name: str) -> ServedModel:
        """The model ``name`` means for ``caller``; ModelNotFound when it means nothing
        (another tenant's adapter looks exactly like a missing one)."""
        if name in self.base_names:
            return self.base
        if caller.tenant is not None and self.registry is not None and self.lora_enabled:
            served = await self._tenant_adapter(caller.tenant.id, name)
            if served is not None:
                return served
        if name in self.static:
            return self.static[name]
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    async def _tenant_adapter(self, tenant_id: int, name: str) -> ServedModel | None:
        return await self.deps.read_through(self._cache, (tenant_id, name),
                                            lambda: self._lookup(tenant_id, name))

    async def _lookup(self, tenant_id: int, name: str) -> ServedModel | None:
        """The row from the database bulkhead; the weights from the local cache, else
        fetched in the store's bulkhead (ObjectStoreError, DependencyUnavailable: the
        error table's 503, naming no bucket, key or endpoint)."""
        found = await self.deps.db.call(self._row, tenant_id, name)
        if found is None:
            return None
        handle, path = found
        if path is None:
            path = await self.deps.store.call(handle.local_path)
        return self.served_from_handle(handle, path)

    def _row(self, tenant_id: int, name: str) -> tuple[AdapterHandle, Path | None] | None:
        from loramux.registry import AdapterNotFound, InvalidName

        try:
            handle = self.registry.resolve(tenant_id, name)
        except (AdapterNotFound, InvalidName):
            return None
        return handle, self.registry.cached_path(handle)

    def served_from_handle(self, handle: AdapterHandle, path: Path | None) -> ServedModel:
        key = str(EngineKey.for_handle(handle))
        with self._lock:
            old = self._keys.get(handle.id)
            self._keys[handle.id] = key
        if old is not None and old != key and self.drop_engine_key is not None:
            self.drop_engine_key(old)
        return ServedModel(
            handle.name,
            LoRARequest(key, _int_id(key), str(path) if path is not None else None),
            dict(handle.default_preset or {}),
            f"tenant-{handle.tenant_id}",
            int(handle.created_at.timestamp()),
            handle.id,
        )

    # --- listing ---------------------------------------------------------------------
    async def list_models(self, caller: Caller) -> list[dict[str, Any]]:
        """OpenAI model cards: the base model, the caller's adapters, the static ones."""
        cards = [self._card(self.base.name, self.created, "loramux", None)]
        seen = {self.base.name}
        if caller.tenant is not None and self.registry is not None and self.lora_enabled:
            handles = await self.deps.db.call(self.registry.list, caller.tenant.id)
            for h in handles:
                if h.status != "ready" or h.name in seen:
                    continue
                seen.add(h.name)
                cards.append(
                    self._card(h.name, int(h.created_at.timestamp()), f"tenant-{h.tenant_id}", self.base.name)
                )
        for name in self.static:
            if name not in seen:
                cards.append(self._card(name, self.created, "loramux", self.base.name))
        return cards

    def _card(self, name: str, created: int, owner: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name, "object": "model", "created": created, "owned_by": owner,
            "root": name, "parent": parent, "family": self.base_family,
        }

    # --- invalidation ----------------------------------------------------------------
    def invalidate(self, tenant_id: int, name: str | None = None) -> None:
        """Forget the cached resolutions of ``tenant_id`` (of one ``name``, when given)."""
        self._cache.discard_where(lambda key: key[0] == tenant_id and (name is None or key[1] == name))

    def on_registry_event(self, kind: str, handle: AdapterHandle | None) -> None:
        """Registry listener: forget cached resolutions; drop deleted or replaced weights
        from the engine (a deleted adapter is evicted). Events without an adapter
        (``key_revoked``) are not this cache's business."""
        if handle is None:
            return
        self.invalidate(handle.tenant_id, handle.name)
        if kind == "deleted":
            with self._lock:
                old = self._keys.pop(handle.id, None)
            keys = {old, str(EngineKey.for_handle(handle))} - {None}
            if self.drop_engine_key is not None:
                for key in keys:
                    self.drop_engine_key(key)
        elif kind == "replaced":
            with self._lock:
                old = self._keys.get(handle.id)
            new = str(EngineKey.for_handle(handle))
            if old is not None and old != new and self.drop_engine_key is not None:
                self.drop_engine_key(old)
                with self._lock:
                    self._keys.pop(handle.id, None)
