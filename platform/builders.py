"""What the service's :class:`~loramux.platform.settings.Settings` build: the engine's
configuration, the registry, the request caps, the default quotas, the dependency
budgets, the error answers' Retry-After values and the authenticator. The same limits
(``max_lora_rank``, ``max_adapter_bytes``) hold for ``serve`` and for ``loramux adapters
upload``, because both build through here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loramux.engine.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputConfig,
)
from loramux.platform.auth import Authenticator, GatewayIdentityAuthenticator
from loramux.platform.bulkheads import Dependencies, DependencyPolicy
from loramux.platform.errors import ErrorContext
from loramux.platform.limits.request import RequestLimits
from loramux.platform.settings import QUOTA_PREFIX, Settings
from loramux.platform.usage.policy import UsagePolicy
from loramux.registry.budgets import DependencyBudgets
from loramux.registry.quotas import Quotas

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService

ENGINE_OPTIONS = tuple(f.name for part in (ModelConfig, CacheConfig, SchedulerConfig,
                                          StructuredOutputConfig, ParallelConfig, LoRAConfig)
                       for f in dataclasses.fields(part) if f.name in Settings.model_fields)
"""The Settings fields that are engine options (same name, passed through as is)."""

def engine_config(settings: Settings) -> EngineConfig:
    """The engine's configuration for these settings (every engine option, by name)."""
    return EngineConfig.from_options(
        **{name: getattr(settings, name) for name in ENGINE_OPTIONS}, enable_lora=settings.enable_lora,
        speculative_config=settings.speculative_config)


def request_limits(settings: Settings) -> RequestLimits:
    """The per-request caps for these settings."""
    return RequestLimits(**{f.name: getattr(settings, f.name)
                            for f in dataclasses.fields(RequestLimits)})


def default_quotas(settings: Settings) -> Quotas:
    """The quotas of tenants without their own, for these settings."""
    return Quotas(**{f.name: getattr(settings, QUOTA_PREFIX + f.name)
                     for f in dataclasses.fields(Quotas)})


def dependency_budgets(settings: Settings) -> DependencyBudgets:
    """The registry's timeouts for these settings."""
    return DependencyBudgets(**{f.name: getattr(settings, f.name)
                                for f in dataclasses.fields(DependencyBudgets)})


def dependency_policy(settings: Settings) -> DependencyPolicy:
    """The bulkheads' sizes, deadlines and breakers for these settings."""
    return DependencyPolicy(**{f.name: getattr(settings, f.name)
                               for f in dataclasses.fields(DependencyPolicy)})


def usage_policy(settings: Settings) -> UsagePolicy:
    """How usage records are written and kept, for these settings."""
    return UsagePolicy(**{f.name: getattr(settings, f.name)
                          for f in dataclasses.fields(UsagePolicy)})


def error_context(settings: Settings) -> ErrorContext:
    """The Retry-After values of the error table's answers for these settings."""
    return ErrorContext(retry_after=settings.retry_after_seconds,
                        dependency_retry_after=settings.dependency_retry_after)


def build_authenticator(settings: Settings, registry: RegistryService | None,
                        deps: Dependencies | None = None) -> Authenticator:
    """Who a request's key says the caller is: tenant and admin keys, or behind gateways
    (``--role engine``) only the gateways' signed identity tokens."""
    if settings.role == "engine":
        if settings.cluster_secret is None:
            raise ValueError("--role engine needs --cluster-secret")
        return GatewayIdentityAuthenticator(registry, settings.cluster_secret.get_secret_value(),
                                            allow_anonymous=settings.allow_anonymous, deps=deps)
    admin_key = settings.admin_key.get_secret_value() if settings.admin_key else None
    return Authenticator(registry, admin_key=admin_key, allow_anonymous=settings.allow_anonymous,
                         deps=deps)


def open_registry(settings: Settings, base_model: Any = None, *,
                  auto_upgrade: bool | None = None) -> RegistryService:
    """The registry for these settings. With ``base_model`` (a folder, or a config)
    uploads are validated against it under the serving limits (``max_lora_rank``,
    ``max_adapter_bytes``), so an adapter the registry accepts is one ``serve`` serves."""
    from loramux.platform.openai.presets import registry_preset_check
    from loramux.registry import build_registry

    s = settings
    return build_registry(
        database_url=s.database_url, s3_bucket=s.s3_bucket, s3_endpoint_url=s.s3_endpoint_url,
        s3_prefix=s.s3_prefix, s3_region=s.s3_region, data_dir=s.data_dir,
        base_model=str(base_model) if isinstance(base_model, Path) else base_model,
        max_lora_rank=s.max_lora_rank, max_adapter_bytes=s.max_adapter_bytes,
        auto_upgrade=auto_upgrade, preset_check=registry_preset_check,
        default_quotas=default_quotas(s), budgets=dependency_budgets(s),
    )
