"""Constants and helpers shared by the platform tests (a uniquely named module: importing
from ``conftest`` is ambiguous when several test folders have one)."""

from __future__ import annotations

from loramux.platform.settings import Settings

BASE = "tiny"
ADMIN_KEY = "admin-secret-for-tests"


USAGE_FLUSH_INTERVAL_S = 0.05
"""The tests' ``usage_flush_interval`` (default 1 s): closing an app's usage writer waits
for its current batch window, up to twice the interval, once per test that builds an app."""


def settings(**kw) -> Settings:
    """The platform tests' settings: the tiny model's name, the admin key, no model cache,
    a short usage batch window; ``kw`` overrides any of them."""
    base = dict(served_model_name=[BASE], admin_key=ADMIN_KEY, model_cache_ttl=0.0,
                usage_flush_interval=USAGE_FLUSH_INTERVAL_S)
    base.update(kw)
    return Settings(**base)
