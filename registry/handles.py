"""What the registry hands out: snapshots of one adapter version (:class:`AdapterHandle`),
an adapter with its versions and rollout (:class:`Release`), audit events
(:class:`AdapterEventInfo`), the object key of a version's weights and the listener type."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

from loramux.adapters.archive import WEIGHTS_NAME
from loramux.registry.cache import cache_entry_name
from loramux.registry.gc import OBJECT_PREFIX
from loramux.registry.rollouts import Rollout

Listener = Callable[[str, "AdapterHandle | None"], None]
"""``listener(kind, handle)``: an adapter change (handle set) or ``key_revoked`` (None)."""


def object_key(sha256: str) -> str:
    """The content-addressed key of an adapter's weights."""
    return f"{OBJECT_PREFIX}{sha256}/{WEIGHTS_NAME}"


@dataclass(frozen=True)
class AdapterHandle:
    """A snapshot of one version of an adapter (with what all its versions share), its
    weights one call away.

    ``id`` is the adapter's (every version shares it), ``version`` this version's number.
    ``local_path()`` fetches the weights into the local disk cache on first use and
    returns a PEFT folder. Engines use the handle (or ``RegistryService.fetch_by_id``) as
    their adapter source.
    """

    id: int
    tenant_id: int
    name: str
    version: int
    """This version's number (1, 2, ...; never reused)."""
    base_model: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    sha256: str
    size_bytes: int
    object_key: str
    status: str
    default_preset: dict[str, Any] | None
    config: dict[str, Any]
    description: str | None
    created_at: datetime
    """When this version was uploaded."""
    updated_at: datetime
    chat_template: str | None = None
    """The adapter's own Jinja chat template (every version shares it); None: the server's."""
    tool_call_parser: str | None = None
    """The adapter's tool-call parser name; None: the server's ``--tool-call-parser``."""
    reasoning_parser: str | None = None
    """The adapter's reasoning parser name; None: the server's ``--reasoning-parser``."""
    _fetch: Callable[[AdapterHandle], Path] | None = field(default=None, repr=False, compare=False)

    @property
    def kind(self) -> str:
        """What the API and the dashboard call it, from the stored config
        (:func:`~loramux.adapters.kinds.adapter_kind`)."""
        from loramux.adapters.kinds import adapter_kind

        return adapter_kind(self.config)

    @property
    def cache_key(self) -> str:
        """Identifies the content (weights + config): versions with other weights or config
        have another one."""
        return cache_entry_name(self.sha256, self.config)

    def local_path(self) -> Path:
        """The adapter's local PEFT folder, fetched from the object store on first use."""
        if self._fetch is None:
            raise RuntimeError("this handle is not attached to a registry")
        return self._fetch(self)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields for the API and the CLI."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["config"] = copy.deepcopy(self.config)
        d["kind"] = self.kind
        d["default_preset"] = copy.deepcopy(self.default_preset)
        d["target_modules"] = list(self.target_modules)
        d["created_at"] = self.created_at.isoformat()
        d["updated_at"] = self.updated_at.isoformat()
        return d


@dataclass(frozen=True)
class Release:
    """An adapter as requests see it: its retained versions and its rollout. What the
    resolvers (engine and gateway) cache per (tenant, name)."""

    versions: dict[int, AdapterHandle]
    """Every retained version by number (oldest first)."""
    rollout: Rollout

    @property
    def newest(self) -> AdapterHandle:
        return self.versions[max(self.versions)]

    @property
    def name(self) -> str:
        return self.newest.name

    @property
    def tenant_id(self) -> int:
        return self.newest.tenant_id


@dataclass(frozen=True)
class AdapterEventInfo:
    id: int
    tenant_id: int | None
    adapter_id: int | None
    adapter_name: str
    kind: str
    actor: str | None
    details: dict[str, Any] | None
    created_at: datetime
