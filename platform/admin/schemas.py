"""Response bodies of the admin API (``/admin/adapters``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class ResidencyRow(BaseModel):
    """One adapter: where it sits (tier ``gpu`` | ``device`` | ``cpu`` | ``disk`` |
    ``store``) and what the engine and the registry know of it."""

    key: str
    """The engine key, ``<tenant id>/<name>@<digest>``."""
    name: str
    tier: str
    slot: int | None = None
    pinned: bool = False
    rank: int | None = None
    in_use: bool = False
    loading: bool = False
    load_seconds: float | None = None
    error: str | None = None
    source: Literal["engine", "static", "registry"] = "engine"
    tenant: str | None = None
    adapter: str | None = None
    """The adapter's name as its tenant calls it."""
    version: int | None = None
    size_bytes: int | None = None


class EngineSummary(BaseModel):
    running: int
    waiting: int
    kv_cache_usage: float
    num_preemptions: int
    max_loras: int
    evictions: int
    lora_enabled: bool


class Residency(BaseModel):
    object: Literal["list"] = "list"
    data: list[ResidencyRow]
    engine: EngineSummary


class ActionResult(BaseModel):
    key: str
    action: str
    done: bool
    detail: str | None = None
