"""loramux.registry – where tenants' adapters are stored and found.

- :mod:`~loramux.registry.models` SQLAlchemy models (Tenant, ApiKey, Adapter, AdapterVersion,
  AdapterEvent, TenantQuota, UsageRecord)
- :mod:`~loramux.registry.db` ``Database`` (engine, sessions, Alembic upgrade/downgrade)
- :mod:`~loramux.registry.store` ``ObjectStore``, ``FileStore``; :mod:`~loramux.registry.s3` ``S3Store``
- :mod:`~loramux.registry.service` ``RegistryService``: upload → validate → store → commit,
  list/get/resolve/delete/set_preset, API keys, audit events, ``gc()``, export
- :mod:`~loramux.registry.factory` ``build_registry``: the embedded default layout and settings
- :mod:`~loramux.registry.versions` versions, rollouts, rollback, retention (mixed into the service)
- :mod:`~loramux.registry.rollouts` ``Rollout``: weighted sticky choice of a version (pure)
- :mod:`~loramux.registry.usage` ``UsageLedger``: usage records in SQL (append, sums, per version)
- :mod:`~loramux.registry.quotas` ``Quotas`` per tenant (``get_quotas``/``set_quotas``/``get_usage``)
- :mod:`~loramux.registry.errors` the ``RegistryError`` family
"""

from loramux.registry.errors import (
    AdapterConflict,
    AdapterNotFound,
    BaseModelNotConfigured,
    InvalidChatSettings,
    InvalidDescription,
    InvalidName,
    InvalidPreset,
    InvalidQuota,
    InvalidRollout,
    NoPreviousVersion,
    ObjectIntegrityError,
    ObjectNotFound,
    ObjectStoreError,
    QuotaExceeded,
    RegistryError,
    SchemaOutOfDate,
    TenantConflict,
    TenantNotFound,
    VersionInUse,
    VersionNotFound,
)
from loramux.registry.factory import build_registry, default_data_dir
from loramux.registry.handles import AdapterHandle, Release
from loramux.registry.quotas import Quotas, TenantUsage
from loramux.registry.service import RegistryService

__all__ = [
    "AdapterConflict",
    "AdapterHandle",
    "AdapterNotFound",
    "BaseModelNotConfigured",
    "InvalidChatSettings",
    "InvalidName",
    "InvalidDescription",
    "InvalidPreset",
    "InvalidQuota",
    "InvalidRollout",
    "NoPreviousVersion",
    "ObjectIntegrityError",
    "ObjectNotFound",
    "ObjectStoreError",
    "QuotaExceeded",
    "Quotas",
    "RegistryError",
    "RegistryService",
    "Release",
    "SchemaOutOfDate",
    "TenantConflict",
    "TenantNotFound",
    "TenantUsage",
    "VersionInUse",
    "VersionNotFound",
    "build_registry",
    "default_data_dir",
]
