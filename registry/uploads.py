"""Uploads (:class:`Uploads`, a part of ``RegistryService``): validate an adapter folder or
archive against the served base model (:class:`UploadChecks`) → write its weights to the
store under a content-addressed key → commit the new version (and its audit event, and what
the retention quota removes) in one transaction → announce it. A failure at any point
leaves no row; an object written by a failed upload is unreferenced, and gc removes it (the
pending marker keeps gc off it while the upload runs).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from loramux.adapters.archive import WEIGHTS_NAME, adapter_folder
from loramux.adapters.format import DEFAULT_MAX_ADAPTER_BYTES, validate_adapter
from loramux.adapters.spec import DEFAULT_MAX_LORA_RANK, MAX_CONFIG_BYTES
from loramux.adapters.vocab import strip_base_copies
from loramux.adapters.weights import LoraWeights
from loramux.registry.chat import check_parser_name, check_template, read_chat_template
from loramux.registry.errors import AdapterConflict, BaseModelNotConfigured
from loramux.registry.files import sha256_file
from loramux.registry.gc import Storage, pending_marker
from loramux.registry.handles import AdapterHandle, object_key
from loramux.registry.models import Adapter, AdapterVersion, Tenant, utcnow
from loramux.registry.names import check_name
from loramux.registry.presets import PresetCheck, check_preset
from loramux.registry.quotas import check_storage
from loramux.registry.rollouts import BUCKETS, next_previous_live
from loramux.registry.tenants import TenantRef, Tenants
from loramux.registry.versions import AdapterReleases, rollout_of

if TYPE_CHECKING:
    from loramux.registry.audit import AdapterAudit
    from loramux.registry.events import EventBus


@dataclass(frozen=True)
class UploadChecks:
    """What an upload is checked against: the served base model (``base_config``, a
    ``config.json`` dict or ``PretrainedConfig``; None: uploads are refused) and the
    serving limits, so an adapter the registry accepts is one the server serves."""

    base_config: Mapping[str, Any] | Any | None = None
    base_model_name: str | None = None
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_adapter_bytes: int = DEFAULT_MAX_ADAPTER_BYTES
    preset_check: PresetCheck | None = None
    """The serving side's preset validator (None: only the stored shape is checked)."""
    base_model_path: str | os.PathLike | None = None
    """The served base's folder: PEFT's full copies of its embedding layers and the added tokens
    an adapter ships are compared with it (``adapters/vocab.py``)."""


def stored_config(spec, folder, checks: UploadChecks) -> dict[str, Any]:
    """The config stored for an upload: the spec's, and the adapter's own added tokens
    (:data:`~loramux.adapters.added_tokens.STORED_KEY`, which the engine's adapter tokenizer
    reads back from the cached ``adapter_config.json``) when it ships any."""
    from loramux.adapters.added_tokens import STORED_KEY, check_added_tokens
    from loramux.adapters.arch import text_config

    config = spec.to_config()
    tokens = check_added_tokens(folder, text_config(checks.base_config).get("vocab_size"),
                                checks.base_model_path or checks.base_model_name)
    if tokens:
        config[STORED_KEY] = [t.to_dict() for t in tokens]
    return config


class Uploads:
    """New adapters and new versions, over the registry's storage and parts."""

    def __init__(self, storage: Storage, tenants: Tenants, adapters: AdapterReleases,
                 audit: AdapterAudit, bus: EventBus, checks: UploadChecks) -> None:
        self.storage = storage
        self.db = storage.db
        self.tenants = tenants
        self.adapters = adapters
        self.audit = audit
        self.bus = bus
        self.checks = checks

    def _require_base(self) -> None:
        if self.checks.base_config is None:
            raise BaseModelNotConfigured(
                "no base model is configured; pass base_model= to build_registry "
                "(or --base-model to the CLI)"
            )

    def validate(self, source: str | os.PathLike, max_copy_bytes: int | None = None) -> LoraWeights:
        """Run the upload checks on an adapter folder or archive without storing anything;
        ``max_copy_bytes``: the tenant's ``max_embedding_copy_bytes`` (None: unlimited)."""
        self._require_base()
        return validate_adapter(
            source,
            self.checks.base_config,
            max_lora_rank=self.checks.max_lora_rank,
            max_bytes=self.checks.max_adapter_bytes,
            base_model_name=self.checks.base_model_name,
            base_folder=self.checks.base_model_path,
            max_copy_bytes=max_copy_bytes,
        )

    def upload(
        self,
        tenant: TenantRef,
        name: str,
        source: str | os.PathLike,
        *,
        actor: str | None = None,
        replace: bool = True,
        default_preset: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> AdapterHandle:
        """Validate an adapter folder or archive and register it as ``name``: version 1
        of a new adapter, or the next version of an existing one. An adapter that follows
        the latest version (no explicit rollout) sends every request to the new version at
        once; one with an explicit rollout keeps it (``name@N`` reaches the new version).
        The tenant's ``max_versions_per_adapter`` removes the oldest version the rollout
        does not name. ``replace=False`` refuses an existing name instead
        (:class:`AdapterConflict`).

        Chat settings (shared by every version): ``chat_template``, else the one the
        folder ships (:func:`~loramux.registry.chat.read_chat_template`), replaces the
        adapter's; an upload with neither keeps it. ``tool_call_parser`` and
        ``reasoning_parser`` replace the adapter's when given, else it keeps its own. Only
        their stored shape is checked here (the platform checks that they work first).

        Raises AdapterValidationError (bad adapter; embedding copies past the tenant's
        ``max_embedding_copy_bytes``), InvalidName, InvalidPreset,
        InvalidChatSettings, TenantNotFound, QuotaExceeded (``max_adapters``, ``max_stored_bytes``,
        ``max_versions_per_adapter``), AdapterConflict, ObjectStoreError.
        """
        check_name(name)
        preset = check_preset(default_preset, self.checks.preset_check)
        chat = {"chat_template": check_template(chat_template),
                "tool_call_parser": check_parser_name("tool_call_parser", tool_call_parser),
                "reasoning_parser": check_parser_name("reasoning_parser", reasoning_parser)}
        self._require_base()
        with self.db.session() as s:
            tenant_id = self.tenants.tenant_id(s, tenant)
            taken = s.scalar(
                select(Adapter.id).where(Adapter.tenant_id == tenant_id, Adapter.name == name)
            )
        if taken is not None and not replace:
            raise self._conflict(name)
        if taken is None:  # fail fast before validating; checked again at commit
            check_storage(self.tenants.get_quotas(tenant_id), self.tenants.get_usage(tenant_id),
                          1, 0)
        with (adapter_folder(source, max_bytes=self.checks.max_adapter_bytes + MAX_CONFIG_BYTES,
                             tmp_dir=self.storage.tmp_dir) as folder,
              tempfile.TemporaryDirectory(dir=self.storage.tmp_dir) as stripped):
            weights = self.validate(folder, self.tenants.get_quotas(tenant_id).max_embedding_copy_bytes)
            chat["chat_template"] = chat["chat_template"] or read_chat_template(folder)
            spec, keep = weights.spec, weights.full_copies
            del weights
            # equal copies of the base's embedding layers are stored once: the base's
            weights_path = strip_base_copies(folder / WEIGHTS_NAME, stripped, keep)
            digest = sha256_file(weights_path)
            fields = dict(
                base_model=self.checks.base_model_name or "unknown",
                rank=spec.r,
                alpha=spec.lora_alpha,
                target_modules=list(spec.target_modules),
                config=stored_config(spec, folder, self.checks),
                sha256=digest,
                size_bytes=weights_path.stat().st_size,
                object_key=object_key(digest),
            )
            # the marker keeps gc() off the object until the row is committed (or not)
            with pending_marker(self.storage.store, digest, self.storage.tmp_dir):
                # Always (re)write: it refreshes the object's age too.
                self.storage.store.put_file(fields["object_key"], weights_path, sha256=digest)
                handle, kind, removed = self.commit(
                    tenant_id, name, fields, preset, actor, replace,
                    {k: v for k, v in chat.items() if v is not None})
        self.bus.notify(kind, handle)
        self.adapters.after_removal(removed)
        return handle

    @staticmethod
    def _conflict(name: str) -> AdapterConflict:
        return AdapterConflict(
            f"adapter {name!r} already exists; pick another name, or upload it as a new "
            "version (replace)"
        )

    def commit(
        self,
        tenant_id: int,
        name: str,
        fields: dict[str, Any],
        preset: dict[str, Any] | None,
        actor: str | None,
        replace: bool,
        settings: dict[str, Any] | None = None,
    ) -> tuple[AdapterHandle, str, list[AdapterHandle]]:
        """The one transaction of an upload (called once its weights are stored): the new
        version, the adapter's ``settings`` it brings (chat template, parsers), the quota
        checks, what the retention removes and the audit events."""
        quotas = self.tenants.get_quotas(tenant_id)
        try:
            with self.db.session() as s:
                # A no-op write takes the tenant's row lock (PostgreSQL) or the database's
                # write lock (SQLite) first, so concurrent uploads of one tenant cannot both
                # pass the storage checks.
                s.execute(update(Tenant).where(Tenant.id == tenant_id).values(name=Tenant.name))
                before = self.tenants.usage_in(s, tenant_id)
                row = s.scalar(
                    select(Adapter)
                    .where(Adapter.tenant_id == tenant_id, Adapter.name == name)
                    .with_for_update()
                )
                if row is not None and not replace:
                    raise self._conflict(name)
                if row is None:
                    check_storage(quotas, before, 1, 0)
                    row = Adapter(tenant_id=tenant_id, name=name, last_version=0,
                                  status="ready", rollout_sticky="user")
                    s.add(row)
                    s.flush()
                    kind, numbers = "uploaded", []
                else:
                    kind = "version_added"
                    numbers = [v.number for v in self.adapters.versions(s, row.id)]
                if preset is not None:
                    row.default_preset = preset
                for column, value in (settings or {}).items():
                    setattr(row, column, value)
                number = row.last_version + 1
                version = AdapterVersion(adapter_id=row.id, number=number, **fields)
                s.add(version)
                row.last_version = number
                row.status = "ready"
                row.updated_at = utcnow()
                if row.rollout_weights is None and numbers:  # follows the latest: moves on
                    row.previous_live = next_previous_live(
                        rollout_of(row, numbers), ((number, BUCKETS),))
                s.flush()
                removed = self.adapters.retain(s, row, quotas.max_versions_per_adapter, number,
                                               actor)
                s.flush()
                after = self.tenants.usage_in(s, tenant_id)
                check_storage(quotas, before, 0, after.stored_bytes - before.stored_bytes)
                details = {"version": number, "sha256": version.sha256}
                if settings:
                    details["chat"] = sorted(settings)
                s.add(self.audit.event(row, kind, actor, details))
                s.flush()
                handle = self.adapters.handle(row, version)
        except IntegrityError:
            raise self._conflict(name) from None
        return handle, kind, removed
