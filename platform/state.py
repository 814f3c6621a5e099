"""The per-app state every route reaches through ``StateDep``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loramux.engine.async_engine import AsyncEngine
from loramux.platform.adapter_service import AdapterService
from loramux.platform.admin_service import AdminService
from loramux.platform.auth import Authenticator
from loramux.platform.metrics import Metrics
from loramux.platform.models import ModelResolver
from loramux.platform.serving import OpenAIServing
from loramux.platform.settings import Settings


@dataclass
class AppState:
    """Everything one server runs on; built once per app (lifespan or ``create_app``)."""

    settings: Settings
    engine: AsyncEngine
    registry: Any | None
    metrics: Metrics
    resolver: ModelResolver
    auth: Authenticator
    openai: OpenAIServing
    admin: AdminService
    adapters: AdapterService | None
    scratch_dir: Path
    owns_engine: bool = False
    owns_registry: bool = False
    cleanups: list = field(default_factory=list)
