"""loramux.registry – where tenants' adapters are stored and found.

- :mod:`~loramux.registry.models` SQLAlchemy models (Tenant, ApiKey, Adapter, AdapterEvent)
- :mod:`~loramux.registry.db` ``Database`` (engine, sessions, Alembic upgrade/downgrade)
- :mod:`~loramux.registry.store` ``ObjectStore``, ``FileStore``; :mod:`~loramux.registry.s3` ``S3Store``
- :mod:`~loramux.registry.service` ``RegistryService``: upload → validate → store → commit,
  list/get/resolve/delete/set_preset, API keys, audit events, ``gc()``, export
- :mod:`~loramux.registry.factory` ``build_registry``: the embedded default layout and settings
- :mod:`~loramux.registry.quotas` ``Quotas`` per tenant (``get_quotas``/``set_quotas``/``get_usage``)
- :mod:`~loramux.registry.errors` the ``RegistryError`` family
"""

from loramux.registry.errors import (
    AdapterConflict,
    AdapterNotFound,
    BaseModelNotConfigured,
    InvalidDescription,
    InvalidName,
    InvalidPreset,
    InvalidQuota,
    ObjectIntegrityError,
    ObjectNotFound,
    ObjectStoreError,
    QuotaExceeded,
    RegistryError,
    SchemaOutOfDate,
    TenantConflict,
    TenantNotFound,
)
from loramux.registry.factory import build_registry, default_data_dir
from loramux.registry.handles import AdapterHandle
from loramux.registry.quotas import Quotas, TenantUsage
from loramux.registry.service import RegistryService

__all__ = [
    "AdapterConflict",
    "AdapterHandle",
    "AdapterNotFound",
    "BaseModelNotConfigured",
    "InvalidName",
    "InvalidDescription",
    "InvalidPreset",
    "InvalidQuota",
    "ObjectIntegrityError",
    "ObjectNotFound",
    "ObjectStoreError",
    "QuotaExceeded",
    "Quotas",
    "RegistryError",
    "RegistryService",
    "SchemaOutOfDate",
    "TenantConflict",
    "TenantNotFound",
    "TenantUsage",
    "build_registry",
    "default_data_dir",
]
