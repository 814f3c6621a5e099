"""Naming rule for tenants and adapters."""

from __future__ import annotations

import re

from loramux.registry.errors import InvalidName

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(name: object, what: str = "adapter") -> str:
    """Return ``name`` if it is 1–128 characters of letters, digits, ``.``, ``_``, ``-``,
    starting with a letter or digit and without ``..`` (the whole string: no trailing
    newline); else raise :class:`InvalidName`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        shown = name if not isinstance(name, str) or len(name) <= 40 else name[:40] + "…"
        raise InvalidName(
            f"invalid {what} name {shown!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return name
