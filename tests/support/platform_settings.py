"""Constants and helpers shared by the platform tests (a uniquely named module: importing
from ``conftest`` is ambiguous when several test folders have one)."""

from __future__ import annotations

from loramux.platform.settings import Settings

BASE = "tiny"
ADMIN_KEY = "admin-secret-for-tests"


def settings(**kw) -> Settings:
    base = dict(served_model_name=[BASE], admin_key=ADMIN_KEY, model_cache_ttl=0.0)
    base.update(kw)
    return Settings(**base)
