"""vLLM's dynamic LoRA API for the caller's tenant (``--allow-runtime-lora-updating``):
``load`` registers an adapter from ``lora_path`` under ``lora_name``, ``unload`` deletes
it, with vLLM's status codes and plain-text success bodies.

``lora_path`` is either an ``s3://`` URL under the tenant's import prefix (or the
operator's ``--s3-import-allow`` list), or a local folder (or archive) under a prefix of
``--lora-path-allow`` (``{tenant}`` in a prefix stands for the caller's tenant name).
Anything else is 400 and nothing is read: relative paths, ``..``, a symlink anywhere
below the allowed prefix, another tenant's prefix. The adapter then goes through the
upload path (``AdapterService``: size cap, validation against the base model, the
registry's quotas), so a load is exactly an upload; this engine warms it afterwards.

The registry is shared by every server: an adapter loaded through one engine is served
by all of them, and an unload removes it everywhere (as a delete does).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.platform.adapter_api.schemas import S3Upload
from loramux.platform.adapter_api.uploads import NothingToRead
from loramux.platform.errors import BadRequest, NotFound, Unprocessable
from loramux.platform.identity import Caller
from loramux.platform.openai.resolver import ModelResolver

if TYPE_CHECKING:
    from loramux.engine.async_engine import AsyncEngine
    from loramux.platform.adapter_api.service import AdapterService

logger = logging.getLogger(__name__)

TENANT_PLACEHOLDER = "{tenant}"


def loaded_message(name: str) -> str:
    return f"Success: LoRA adapter '{name}' added successfully."


def unloaded_message(name: str) -> str:
    return f"Success: LoRA adapter '{name}' removed successfully."


def no_adapter(path: str) -> NotFound:
    """vLLM's 404 for a path with no adapter."""
    return NotFound(f"No adapter found for {path}", param="lora_path", code="adapter_not_found")


def allowed_local_path(lora_path: str, tenant: str, allow: list[str]) -> Path:
    """The local folder or file ``lora_path`` names, once it is allowed: absolute, no
    ``..``, under one of ``allow`` (``{tenant}`` = ``tenant``), no symlink below that
    prefix. 400 when not allowed, 404 when nothing is there; nothing below the prefix is
    read but directory entries' types."""
    refuse = BadRequest(
        "lora_path must be an s3:// URL under your import prefix or an absolute path under "
        "a folder this server allows (--lora-path-allow)", param="lora_path",
        code="lora_path_not_allowed")
    if not lora_path.startswith("/") or "\x00" in lora_path:
        raise refuse
    parts = Path(lora_path).parts
    if ".." in parts or "." in parts:
        raise refuse
    for prefix in allow:
        root = Path(os.path.normpath(prefix.replace(TENANT_PLACEHOLDER, tenant)))
        if parts[:len(root.parts)] != root.parts or len(parts) == len(root.parts):
            continue
        if not root.is_dir():
            raise no_adapter(lora_path)
        here = root
        for part in parts[len(root.parts):]:
            here = here / part
            if _is_link(here, lora_path):
                raise _symlink()
        if stat.S_ISDIR(os.lstat(here).st_mode) and any(
                _is_link(here / f, None) for f in ADAPTER_FILES):
            raise _symlink()
        return here
    raise refuse


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
"""What a load reads of a PEFT folder (``adapter_api.uploads.read_local``)."""


def _symlink() -> BadRequest:
    return BadRequest("lora_path must not go through a symlink", param="lora_path",
                      code="lora_path_not_allowed")


def _is_link(path: Path, missing: str | None) -> bool:
    """True for a symlink; a missing entry is 404 for ``missing`` (None: not a link)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except FileNotFoundError:
        if missing is None:
            return False
        raise no_adapter(missing) from None


class RuntimeLoRA:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` over the adapter API."""

    def __init__(self, adapters: AdapterService, resolver: ModelResolver, engine: AsyncEngine,
                 *, lora_path_allow: list[str], warm_timeout: float = 10.0) -> None:
        self.adapters = adapters
        self.resolver = resolver
        self.engine = engine
        self.lora_path_allow = list(lora_path_allow)
        self.warm_timeout = warm_timeout

    async def load(self, caller: Caller, name: str, lora_path: str, replace: bool) -> str:
        """Register ``lora_path`` as the tenant's adapter ``name`` (``replace``: vLLM's
        ``load_inplace``, a new version); the success body, or an APIError."""
        from loramux.adapters.errors import AdapterValidationError
        from loramux.engine.lora.manager import LoRAError
        from loramux.registry import errors as r

        if name in self.resolver.base_names:
            raise BadRequest(f"'{name}' is the base model's name", param="lora_name")
        try:
            if lora_path.startswith("s3://"):
                if not self.adapters.import_allowed(caller, lora_path):
                    raise BadRequest(
                        "lora_path: this server imports adapters only from your own prefix "
                        "(imports/<tenant>/ in the server's bucket) and the locations its "
                        "operator allows (--s3-import-allow)", param="lora_path",
                        code="lora_path_not_allowed")
                await self.adapters.upload_s3(caller, S3Upload(name=name, source=lora_path),
                                              replace)
            else:
                path = allowed_local_path(lora_path, caller.tenant.name, self.lora_path_allow)
                if path.is_dir() and not (path / "adapter_config.json").is_file():
                    raise no_adapter(lora_path)
                await self.adapters.upload_local(caller, name, path, replace)
        except NothingToRead:
            raise no_adapter(lora_path) from None
        except r.AdapterConflict:
            raise BadRequest(f"The lora adapter '{name}' has already been loaded.",
                             param="lora_name", code="adapter_exists") from None
        except (AdapterValidationError, LoRAError, Unprocessable) as e:
            raise BadRequest(str(e), param="lora_path", code="invalid_adapter") from None
        logger.info("runtime LoRA load", extra={"adapter": name, "tenant": caller.tenant.name})
        await self._warm(caller, name)
        return loaded_message(name)

    async def _warm(self, caller: Caller, name: str) -> None:
        """Bring the new adapter into this engine (as vLLM's load does); a failure here
        is only logged: the adapter loads on its first request."""
        try:
            served = await self.resolver.resolve(caller, name)
            if served.lora is not None and self.engine.lora_enabled:
                await self.engine.register_adapter(served.lora)
                await self.engine.warm_adapter(served.lora.key, timeout=self.warm_timeout)
        except Exception:
            logger.warning("could not warm the loaded adapter %r", name, exc_info=True)

    async def unload(self, caller: Caller, name: str) -> str:
        """Delete the tenant's adapter ``name`` (every engine drops it); the success body."""
        from loramux.registry import errors as r

        try:
            await self.adapters.delete(caller, name)
        except (r.AdapterNotFound, r.InvalidName):
            raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="adapter_not_found") from None
        logger.info("runtime LoRA unload", extra={"adapter": name, "tenant": caller.tenant.name})
        return unloaded_message(name)
