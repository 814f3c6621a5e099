"""Response bodies of the gateway's own routes (everything else is the engines' answer)."""

from __future__ import annotations

from pydantic import BaseModel


class GatewayReadiness(BaseModel):
    """``GET /ready`` of a gateway: 200 while any engine is live."""

    status: str
    """``ready``, ``degraded`` (Redis unreachable: routing on the last known view) or
    ``no engines``."""
    engines: list[str]
    """The live engines routed over."""
    redis: str
    """``ok`` or ``unreachable`` (why: in the log)."""
    dependencies: dict[str, str] = {}
    """``ok`` / ``degraded`` / ``down`` per dependency (database, redis)."""

