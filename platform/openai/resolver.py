"""Which model a request's ``model`` field names: the base model, a static adapter
(``--lora-modules``) or one of the caller's tenant adapters (registry, cached), and for a
tenant adapter which version: ``name@N`` pins version N; the plain name follows the
adapter's rollout (:meth:`loramux.registry.rollouts.Rollout.choose`, sticky per the
request's ``user`` or the caller's API key; the choice is :mod:`.versions`).

Engine adapter keys (:class:`~loramux.platform.identity.EngineKey`) are unique across
tenants and versions: the versions of one adapter are distinct
engine adapters, so a rollout change moves only new requests (queued and running ones keep
the version they resolved to). :meth:`ModelResolver.on_registry_event` drops the keys of
removed versions and deleted adapters from the engine (their queued requests fail with
``adapter_gone``; running ones finish).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loramux.adapters.added_tokens import TOKEN_FILES
from loramux.engine.lora_request import LoRARequest
from loramux.platform.bulkheads import Dependencies
from loramux.platform.errors import ModelNotFound
from loramux.platform.identity import STATIC_OWNER, Caller, EngineKey
from loramux.platform.openai.versions import choose_version, split_version
from loramux.platform.settings import setting_default
from loramux.platform.ttl_cache import TTLCache

if TYPE_CHECKING:
    from loramux.registry.handles import AdapterHandle, Release
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
    version: int | None = None
    """The tenant adapter's version serving the request (None: base model, static adapter)."""
    tenant_id: int | None = None
    chat_template: str | None = None
    """The adapter's own Jinja chat template (a tenant adapter's from the registry, every
    version the same; a static adapter's from its folder); None: the server's template.
    Tenant input: render it sandboxed (``RequestGate``'s renderer), never in-process."""
    tool_call_parser: str | None = None
    """The adapter's tool-call parser name (registered, checked against the served
    tokenizer at upload / PATCH); None: the server's ``--tool-call-parser``."""
    reasoning_parser: str | None = None
    """The adapter's reasoning parser name; None: the server's ``--reasoning-parser``."""

    @property
    def label(self) -> str:
        """Metrics label: the engine key, or ``base``."""
        return self.lora.lora_name if self.lora is not None else "base"

    @property
    def adapter(self) -> str | None:
        """The adapter's name (None for the base model): what usage records carry."""
        return self.name if self.lora is not None else None


@dataclass
class _Entry:
    """A cached release and what was built from it (per version)."""

    release: Release
    paths: dict[int, Path | None]
    """Each version's local folder when the disk cache held it at lookup (else None)."""
    served: dict[int, ServedModel] = field(default_factory=dict)


def _int_id(key: str) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) + 1


def folder_digest(path: Path) -> str:
    """sha256 over an adapter folder's config, weights and added-token files (static
    adapters: their identity keys the engine's slots, prefix cache and tokenizers)."""
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors", *TOKEN_FILES):
        p = path / name
        if p.is_file():
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def _folder_template(name: str, path: Path) -> str | None:
    """A static adapter's own chat template (``chat_template.jinja``, else
    ``tokenizer_config.json``'s, by the registry's rule); None, with a warning, when its
    files cannot be read as one."""
    from loramux.registry.chat import read_chat_template
    from loramux.registry.errors import InvalidChatSettings

    try:
        return read_chat_template(path)
    except (InvalidChatSettings, OSError) as e:
        logger.warning("--lora-modules %s: its chat template is not used: %s", name, e)
        return None


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
                name, LoRARequest(key, _int_id(key), str(path)), {}, "loramux", self.created,
                chat_template=_folder_template(name, path),
            )
        self.deps = deps or Dependencies()
        self._cache: TTLCache[tuple[int, str], _Entry] = self.deps.stale_cache(
            ttl, cache_none=False)
        self._owner: dict[str, int] = {}  # engine key in use -> adapter id
        self._keys: dict[tuple[int, str], set[str]] = {}  # (tenant, name) -> engine keys in use
        self._generation: dict[tuple[int, str], int] = {}
        self._fetching: dict[str, asyncio.Future] = {}  # cache key -> store fetch in flight
        self._lock = threading.Lock()

    def adapter_id_of(self, key: str) -> int | None:
        """The registry id of the adapter whose version is served under engine key ``key``
        (None when no resolution in use has it, e.g. a static ``--lora-modules`` adapter)."""
        with self._lock:
            return self._owner.get(key)

    # --- resolution ----------------------------------------------------------------
    async def resolve(self, caller: Caller, name: str, *, user: str | None = None,
                      pinned: int | None = None) -> ServedModel:
        """The model ``name`` means for ``caller``; ModelNotFound when it means nothing
        (another tenant's adapter looks exactly like a missing one). For a tenant adapter:
        ``name@N`` (or ``pinned``, what a gateway chose) is version N, the plain name a
        version by the rollout, sticky per ``user`` or the caller's key."""
        if name in self.base_names:
            return self.base
        if caller.tenant is not None and self.registry is not None and self.lora_enabled:
            adapter, number = split_version(name)
            entry = await self._tenant_adapter(caller.tenant.id, adapter)
            if entry is not None:
                version = choose_version(entry.release, caller, user,
                                         number if number is not None else pinned)
                if version is None:
                    raise ModelNotFound(
                        f"The model `{name}` does not exist: adapter `{adapter}` has no version "
                        f"{number if number is not None else pinned} (its versions: "
                        f"{', '.join(map(str, entry.release.versions))}).", param="model")
                return await self._served(entry, version)
        if name in self.static:
            return self.static[name]
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    async def release(self, caller: Caller, name: str) -> Release | None:
        """The caller's adapter ``name`` with its versions and rollout (cached), or None."""
        if caller.tenant is None or self.registry is None:
            return None
        entry = await self._tenant_adapter(caller.tenant.id, name)
        return entry.release if entry is not None else None

    async def _tenant_adapter(self, tenant_id: int, name: str) -> _Entry | None:
        return await self.deps.read_through(self._cache, (tenant_id, name),
                                            lambda: self._lookup(tenant_id, name))

    async def _lookup(self, tenant_id: int, name: str) -> _Entry | None:
        """The release from the database bulkhead (again if it changed meanwhile: a
        listener bumped its generation), with each version's local folder when cached."""
        key = (tenant_id, name)
        for _ in range(2):
            generation = self._generation.get(key, 0)
            found = await self.deps.db.call(self._row, tenant_id, name)
            if self._generation.get(key, 0) == generation:
                break
        return found

    def _row(self, tenant_id: int, name: str) -> _Entry | None:
        from loramux.registry import AdapterNotFound, InvalidName

        try:
            release = self.registry.resolve(tenant_id, name)
        except (AdapterNotFound, InvalidName):
            return None
        return _Entry(release, {n: self.registry.cached_path(h)
                                for n, h in release.versions.items()})

    async def _served(self, entry: _Entry, version: int) -> ServedModel:
        """The ServedModel of one version: the weights from the local cache, else fetched
        in the store's bulkhead (ObjectStoreError, DependencyUnavailable: the error table's
        503, naming no bucket, key or endpoint)."""
        served = entry.served.get(version)
        if served is not None:
            return served
        handle = entry.release.versions[version]
        path = entry.paths.get(version)
        if path is None:
            path = entry.paths[version] = await self._fetch(handle)
        served = entry.served[version] = self.served_from_handle(handle, path)
        return served

    async def _fetch(self, handle: AdapterHandle) -> Path:
        """One version's weights from the store, once for every request waiting on them
        (a burst for a cold adapter is one store call, not one per request)."""
        key = handle.cache_key
        loop = asyncio.get_running_loop()
        pending = self._fetching.get(key)
        if pending is None or pending.get_loop() is not loop:
            pending = asyncio.ensure_future(self.deps.store.call(handle.local_path))
            self._fetching[key] = pending

            def done(f: asyncio.Future, k: str = key) -> None:
                if self._fetching.get(k) is f:
                    del self._fetching[k]
                if not f.cancelled():
                    f.exception()  # retrieved: a failure reaches every waiter, not the log

            pending.add_done_callback(done)
        return await asyncio.shield(pending)

    def served_from_handle(self, handle: AdapterHandle, path: Path | None) -> ServedModel:
        """The ServedModel of one adapter version whose weights are at ``path``."""
        key = str(EngineKey.for_handle(handle))
        with self._lock:
            self._owner[key] = handle.id
            self._keys.setdefault((handle.tenant_id, handle.name), set()).add(key)
        return ServedModel(
            handle.name,
            LoRARequest(key, _int_id(key), str(path) if path is not None else None),
            dict(handle.default_preset or {}),
            f"tenant-{handle.tenant_id}",
            int(handle.created_at.timestamp()),
            handle.id,
            handle.version,
            handle.tenant_id,
            chat_template=handle.chat_template,
            tool_call_parser=handle.tool_call_parser,
            reasoning_parser=handle.reasoning_parser,
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
        """Forget the cached resolutions of ``tenant_id`` (of one ``name``, when given);
        a lookup in flight is done again."""
        with self._lock:
            for key in [k for k in self._generation if k[0] == tenant_id] if name is None \
                    else [(tenant_id, name)]:
                self._generation[key] = self._generation.get(key, 0) + 1
        self._cache.discard_where(lambda key: key[0] == tenant_id and (name is None or key[1] == name))

    def forget_all(self) -> None:
        """Forget every cached resolution (events may have been missed)."""
        with self._lock:
            for key in self._generation:
                self._generation[key] += 1
        self._cache.clear()

    def drop_adapter(self, tenant_id: int, name: str, keys: set[str] = frozenset()) -> None:
        """Drop from the engine every version of ``(tenant_id, name)`` this server served
        (and ``keys``): the adapter was deleted."""
        with self._lock:
            dropped = self._keys.pop((tenant_id, name), set()) | set(keys)
            for key in dropped:
                self._owner.pop(key, None)
        if self.drop_engine_key is not None:
            for key in dropped:
                self.drop_engine_key(key)

    def drop_version(self, tenant_id: int, name: str, key: str) -> None:
        """Drop one removed version's engine key from the engine, unless a version still
        retained has the same content (one engine adapter serves both). Called from the
        registry's listeners and the cluster's events (threads, never the event loop)."""
        if self._still_served(tenant_id, name, key):
            return
        with self._lock:
            self._keys.get((tenant_id, name), set()).discard(key)
            self._owner.pop(key, None)
        if self.drop_engine_key is not None:
            self.drop_engine_key(key)

    def _still_served(self, tenant_id: int, name: str, key: str) -> bool:
        from loramux.registry import AdapterNotFound

        if self.registry is None:
            return False
        try:
            release = self.registry.release(tenant_id, name)
        except AdapterNotFound:
            return False
        except Exception:  # the database is down: drop it (a later request reloads it)
            logger.warning("could not check whether %s is still in use; dropping it", key)
            return False
        return any(str(EngineKey.for_handle(h)) == key for h in release.versions.values())

    def on_registry_event(self, kind: str, handle: AdapterHandle | None) -> None:
        """Registry listener: forget cached resolutions (a new version, a rollout change
        take effect for the next request); drop deleted adapters and removed versions
        from the engine. Events without an adapter (``key_revoked``) are not this
        cache's business."""
        if handle is None:
            return
        self.invalidate(handle.tenant_id, handle.name)
        key = str(EngineKey.for_handle(handle))
        if kind == "deleted":
            self.drop_adapter(handle.tenant_id, handle.name, {key})
        elif kind == "version_removed":
            self.drop_version(handle.tenant_id, handle.name, key)
