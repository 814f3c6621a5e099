"""The tenant adapter API's logic: upload (multipart or ``s3://``; a new name is version 1,
an existing one gets its next version), list, get, patch, delete (which evicts every
version from the engine), export (merged model to the store); versions and rollouts in
:mod:`.releases`.

Short registry calls run in the database bulkhead, uploads and exports in a worker
thread; registry errors are raised as they are
(the error table makes each the HTTP error a client can act on). Another tenant's adapter is reported exactly like a
missing one (the registry scopes every query to the caller's tenant).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from loramux.adapters.archive import adapter_folder
from loramux.adapters.spec import MAX_CONFIG_BYTES
from loramux.engine import omp_threads
from loramux.platform.adapter_api.chat import CHAT_FIELDS, ChatSettingsCheck
from loramux.platform.adapter_api.releases import ReleaseService
from loramux.platform.adapter_api.schemas import (
    AdapterDeleted,
    AdapterExport,
    AdapterInfo,
    AdapterList,
    AdapterPatch,
    AdapterSummary,
    S3Upload,
)
from loramux.platform.adapter_api.uploads import (
    Received,
    fetch_s3,
    parse_bool,
    parse_preset_field,
    parse_s3_uri,
    read_local,
    receive_multipart,
)
from loramux.platform.errors import BadRequest, Forbidden
from loramux.platform.identity import Caller
from loramux.platform.openai.presets import validate_preset
from loramux.platform.openai.resolver import ModelResolver
from loramux.registry.chat import read_chat_template

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService
    from loramux.registry.store import ObjectStore

logger = logging.getLogger(__name__)


class AdapterService:
    """Tenant adapter operations over the registry."""

    def __init__(
        self,
        registry: RegistryService,
        resolver: ModelResolver,
        *,
        scratch_dir: Path,
        max_upload_bytes: int,
        s3_endpoint_url: str | None = None,
        s3_import_allow: list[str] | None = None,
        own_s3_root: str | None = None,
        flush_usage=None,
        chat: ChatSettingsCheck,
    ) -> None:
        """``flush_usage``: the usage writer's flush (the versions' numbers see this
        server's last requests). ``chat``: checks an adapter's template and parsers before
        the registry stores them."""
        self.registry = registry
        self.resolver = resolver
        self.scratch = scratch_dir
        self.max_upload_bytes = max_upload_bytes
        self.s3_endpoint_url = s3_endpoint_url
        self.s3_import_allow = [_as_prefix(p) for p in s3_import_allow or ()]
        self.own_s3_root = _as_prefix(own_s3_root) if own_s3_root else None
        self._export_lock = asyncio.Lock()
        self.chat = chat
        self.releases = ReleaseService(registry, resolver.deps, flush_usage)
        """Versions, rollouts and rollback (``/v1/adapters/{name}/versions``, ``/rollout``,
        ``/rollback``)."""

    async def _call(self, fn, *args, **kwargs):
        """A short registry call (database) in the database bulkhead, within its deadline;
        its errors go to the error table as raised."""
        return await self.resolver.deps.db.call(fn, *args, **kwargs)

    @staticmethod
    async def _long(fn, *args, **kwargs):
        """An upload or export step: bounded by its size and each dependency's own
        timeouts (S3 read timeout and attempts, statement timeout), not by a deadline;
        in the default worker pool, so a stalled store cannot starve the bulkheads; its torch
        work (an upload's checks, an export's merge) on that thread alone, leaving the cores'
        OpenMP teams to the engine's steps (``engine/omp_threads.py``)."""
        return await run_in_threadpool(omp_threads.alone, fn, *args, **kwargs)

    @staticmethod
    def _actor(caller: Caller) -> str:
        return f"tenant:{caller.tenant.name}" if caller.tenant is not None else "admin"

    # --- upload -------------------------------------------------------------------------
    async def upload_multipart(self, caller: Caller, request: Request) -> AdapterInfo:
        """A new adapter, or a new version of an existing one (``replace`` is accepted for
        older clients and changes nothing)."""
        received = await receive_multipart(request, self.scratch, self.max_upload_bytes)
        try:
            name = received.fields.get("name") or ""
            if not name:
                raise BadRequest("the form field `name` is required", param="name")
            preset = parse_preset_field(received.fields.get("preset"))
            parse_bool(received.fields.get("replace"), "replace")
            chat = {k: received.fields[k] for k in CHAT_FIELDS if received.fields.get(k, "").strip()}
            return await self._upload(caller, name, received, preset, chat=chat)
        finally:
            await run_in_threadpool(received.cleanup)

    def import_prefixes(self, caller: Caller) -> list[str]:
        """Where ``caller`` may import from: its own prefix (``imports/<tenant>/`` in the
        server's bucket) and the operator's ``--s3-import-allow`` list."""
        own = [f"{self.own_s3_root}imports/{caller.tenant.name}/"] if self.own_s3_root else []
        return own + self.s3_import_allow

    def import_allowed(self, caller: Caller, source: str) -> bool:
        """True when ``caller`` may import from the ``s3://`` URI ``source`` (400 when it
        is not one); nothing is read."""
        bucket, key = parse_s3_uri(source)
        return "/../" not in f"/{key}/" and any(
            f"s3://{bucket}/{key}".startswith(p) for p in self.import_prefixes(caller))

    def check_import_source(self, caller: Caller, source: str) -> None:
        """403 for an ``s3://`` source outside the caller's allowed prefixes."""
        if not self.import_allowed(caller, source):
            raise Forbidden(
                "this server imports adapters only from your own prefix (imports/<tenant>/ "
                "in the server's bucket) and the locations its operator allows "
                "(--s3-import-allow)", param="source", code="source_not_allowed",
            )

    async def upload_s3(self, caller: Caller, body: S3Upload, replace: bool = True) -> AdapterInfo:
        self.check_import_source(caller, body.source)
        received: Received = await run_in_threadpool(
            fetch_s3, body.source, self.scratch, self.max_upload_bytes,
            endpoint_url=self.s3_endpoint_url,
        )
        chat = {k: getattr(body, k) for k in CHAT_FIELDS if getattr(body, k) is not None}
        try:
            return await self._upload(caller, body.name, received, body.preset, replace, chat)
        finally:
            await run_in_threadpool(received.cleanup)

    async def upload_local(self, caller: Caller, name: str, path: Path, replace: bool) -> AdapterInfo:
        """Register the adapter at the local ``path`` (a PEFT folder or an archive) that
        the caller was allowed to name (the route checks the allow-list): copied under
        the upload cap, then the same validation as an upload."""
        received: Received = await run_in_threadpool(
            read_local, path, self.scratch, self.max_upload_bytes)
        try:
            return await self._upload(caller, name, received, None, replace)
        finally:
            await run_in_threadpool(received.cleanup)

    async def _upload(self, caller: Caller, name: str, received: Received, preset,
                      replace: bool = True, chat: dict[str, str] | None = None) -> AdapterInfo:
        """``replace`` False refuses an existing name (vLLM's load API without
        ``load_inplace``); else an existing name gets its next version. ``chat``: the
        request's own chat settings; a template it leaves out is the one the adapter ships
        (``chat_template.jinja``, else ``tokenizer_config.json``), else the adapter keeps
        its own. Settings are checked before anything is stored."""
        if preset is not None:
            validate_preset(preset)
        chat = {k: v.strip() if k != "chat_template" else v for k, v in (chat or {}).items()}
        async with self._unpacked(received.source()) as folder:
            if "chat_template" not in chat:
                chat["chat_template"] = await self._long(read_chat_template, folder)
            await self.chat.check(chat, caller.tenant.id)
            handle = await self._long(
                self.registry.upload, caller.tenant.id, name, folder,
                actor=self._actor(caller), replace=replace, default_preset=preset, **chat,
            )
        logger.info("adapter uploaded", extra={"adapter": name, "tenant": caller.tenant.name,
                                               "version": handle.version, "bytes": received.size})
        return AdapterInfo.of(handle)

    @contextlib.asynccontextmanager
    async def _unpacked(self, source: Path):
        """The adapter folder of an upload (an archive extracted under the scratch folder,
        removed afterwards): its template is read and checked from the same files the
        registry then validates and stores."""
        unpack = adapter_folder(source, tmp_dir=self.scratch,
                                max_bytes=self.registry.max_adapter_bytes + MAX_CONFIG_BYTES)
        folder = await self._long(unpack.__enter__)
        try:
            yield folder
        finally:
            await run_in_threadpool(unpack.__exit__, None, None, None)

    # --- read / change ------------------------------------------------------------------
    async def list(self, caller: Caller) -> AdapterList:
        handles = await self._call(self.registry.list, caller.tenant.id)
        return AdapterList(data=[AdapterSummary.of(h) for h in handles])

    async def get(self, caller: Caller, name: str) -> AdapterInfo:
        return AdapterInfo.of(await self._call(self.registry.get, caller.tenant.id, name))

    async def patch(self, caller: Caller, name: str, body: AdapterPatch) -> AdapterInfo:
        """Change what the body names (``null`` clears). Every field is checked before
        any is stored; chat settings take effect on every server's next request."""
        fields = body.model_fields_set
        handle = None
        if "preset" in fields and body.preset is not None:
            validate_preset(body.preset)
        chat = {k: getattr(body, k) or None for k in CHAT_FIELDS if k in fields}
        if chat:
            await self._call(self.registry.get, caller.tenant.id, name)  # 404 before a render
            await self.chat.check(chat, caller.tenant.id)
        if "preset" in fields:
            handle = await self._call(
                self.registry.set_preset, caller.tenant.id, name, body.preset or None,
                actor=self._actor(caller),
            )
        if "description" in fields:
            handle = await self._call(
                self.registry.set_description, caller.tenant.id, name, body.description,
                actor=self._actor(caller),
            )
        if chat:
            handle = await self._call(self.registry.set_chat, caller.tenant.id, name,
                                      actor=self._actor(caller), **chat)
        if handle is None:
            handle = await self._call(self.registry.get, caller.tenant.id, name)
        return AdapterInfo.of(handle)

    async def delete(self, caller: Caller, name: str) -> AdapterDeleted:
        handle = await self._call(
            self.registry.delete, caller.tenant.id, name, actor=self._actor(caller)
        )
        return AdapterDeleted(id=handle.name)

    # --- export -------------------------------------------------------------------------
    async def export(self, caller: Caller, name: str, check: bool,
                     version: int | None = None) -> AdapterExport:
        handle = await self._call(self.registry.get, caller.tenant.id, name) if version is None \
            else await self._call(self.registry.get_version, caller.tenant.id, name, version)
        async with self._export_lock:
            self.scratch.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix="export-", dir=self.scratch))
            try:
                out = tmp / "merged"
                await self._long(
                    self.registry.export, caller.tenant.id, name, out, check=check,
                    actor=self._actor(caller), progress=False, version=handle.version,
                )
                prefix = (
                    f"exports/tenant-{handle.tenant_id}/{handle.name}/"
                    f"v{handle.version}-{handle.sha256[:12]}"
                )
                files = await self._long(_put_folder, self.registry.store, out, prefix)
            finally:
                await run_in_threadpool(shutil.rmtree, tmp, True)
        return AdapterExport(
            id=handle.name, version=handle.version, base_model=handle.base_model,
            location=self.registry.store.folder_uri(prefix), files=files,
        )


def _as_prefix(uri: str) -> str:
    """``s3://bucket/prefix`` as a prefix that matches only whole path segments."""
    return uri if uri.endswith("/") else uri + "/"


def _put_folder(store: ObjectStore, folder: Path, prefix: str) -> list[str]:
    from loramux.registry.files import sha256_file

    keys = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(folder).as_posix()}"
        store.put_file(key, path, sha256=sha256_file(path))
        keys.append(key)
    return keys

