"""Which version of a tenant adapter one request is served by: ``name@N`` pins version N
(:func:`split_version`), so does a gateway's :data:`VERSION_HEADER` (:func:`pinned_version`);
the plain name follows the adapter's rollout (:func:`choose_version`, sticky per the
request's ``user`` or the caller's API key). Engines and gateways pick alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from loramux.platform.errors import BadRequest
from loramux.platform.identity import Caller

if TYPE_CHECKING:
    from loramux.registry.handles import Release

VERSION_HEADER = "X-LoRAMux-Adapter-Version"
"""On a response: the tenant adapter version that served it. On a request: the version to
serve (a gateway pins what it chose by the rollout)."""


def split_version(model: str) -> tuple[str, int | None]:
    """``"sql-lora@3"`` → ``("sql-lora", 3)``; any other name → ``(name, None)`` (adapter
    names never hold ``@``)."""
    name, sep, number = model.rpartition("@")
    if sep and name and number.isascii() and number.isdigit() and len(number) <= 9:
        return name, int(number)
    return model, None


def pinned_version(headers: Mapping[str, str]) -> int | None:
    """The version a request's :data:`VERSION_HEADER` pins (what a gateway sends once it
    chose by the rollout; a client may pin its own adapter so too), None without one."""
    raw = headers.get(VERSION_HEADER)
    if raw is None:
        return None
    raw = raw.strip()
    if not (raw.isascii() and raw.isdigit() and 0 < len(raw) <= 9) or int(raw) < 1:
        raise BadRequest(f"the {VERSION_HEADER} header must be a version number, got "
                         f"{raw[:20]!r}", param=VERSION_HEADER, code="invalid_parameter")
    return int(raw)


def sticky_value(release: Release, caller: Caller, user: str | None) -> str | None:
    """What keeps ``caller`` on one version of ``release``'s rollout (None: drawn by weight)."""
    mode = release.rollout.sticky
    if mode == "user":
        return user or None
    if mode == "key":
        return caller.key_prefix
    return None


def choose_version(release: Release, caller: Caller, user: str | None,
                   pinned: int | None = None) -> int | None:
    """The version one request is served by: ``pinned`` if given (None when the adapter has
    no such version), else by the rollout. Gateways and engines pick alike."""
    if pinned is not None:
        return pinned if pinned in release.versions else None
    salt = f"{release.tenant_id}/{release.name}"
    return release.rollout.choose(salt, sticky_value(release, caller, user))
