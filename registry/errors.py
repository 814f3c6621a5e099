"""The registry's exception family. Every message says what a user can do about it."""

from __future__ import annotations


class RegistryError(Exception):
    """Base class of registry errors."""


class InvalidName(RegistryError, ValueError):
    """A tenant or adapter name breaks the naming rule."""


class InvalidPreset(RegistryError, ValueError):
    """A default sampling preset is not a valid set of sampling parameters."""


class InvalidDescription(RegistryError, ValueError):
    """An adapter description is too long."""


class InvalidChatSettings(RegistryError, ValueError):
    """An adapter's chat template or parser name cannot be stored (``param`` names the
    field: ``chat_template``, ``tool_call_parser``, ``reasoning_parser``)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


class InvalidQuota(RegistryError, ValueError):
    """A quota value is not a positive integer (or ``None`` for unlimited)."""


class QuotaExceeded(RegistryError):
    """An upload would take a tenant past ``max_adapters``, ``max_stored_bytes`` or
    ``max_versions_per_adapter`` (every older version in use by the rollout).

    ``quota`` is the field name, ``limit`` its value, ``current`` the tenant's usage
    before the upload and ``requested`` what the upload adds.
    """

    def __init__(self, quota: str, limit: int, current: int, requested: int, unit: str) -> None:
        self.quota, self.limit, self.current, self.requested = quota, limit, current, requested
        advice = ("change the rollout so that an older version is free to go, delete a "
                  "version" if quota == "max_versions_per_adapter" else "delete adapters")
        super().__init__(
            f"quota {quota} exceeded: the tenant uses {current} {unit} of {limit} and this "
            f"upload needs {requested} more; {advice} or ask the operator to raise it"
        )


class TenantNotFound(RegistryError, LookupError):
    """No tenant with that name or id."""


class TenantConflict(RegistryError):
    """A tenant with that name already exists."""


class AdapterNotFound(RegistryError, LookupError):
    """No adapter with that name for this tenant (another tenant's adapter looks the same)."""


class AdapterConflict(RegistryError):
    """The tenant already has an adapter with that name."""


class BaseModelNotConfigured(RegistryError):
    """An operation needs the base model (upload, export) but none was configured."""


class SchemaOutOfDate(RegistryError):
    """The database schema is not at the migrations' head revision."""


class ObjectStoreError(RegistryError):
    """The object store failed (network, permissions, missing bucket)."""


class ObjectNotFound(ObjectStoreError, LookupError):
    """No object under that key."""


class ObjectIntegrityError(ObjectStoreError):
    """An object's bytes do not match its sha256."""


class VersionNotFound(AdapterNotFound):
    """The adapter has no version by that number (never had, or it was removed)."""


class InvalidRollout(RegistryError, ValueError):
    """A rollout's weights or sticky mode are not valid; ``param`` names the field."""

    def __init__(self, message: str, param: str = "weights") -> None:
        super().__init__(message)
        self.param = param


class VersionInUse(RegistryError):
    """A version the adapter's rollout names cannot be deleted."""


class NoPreviousVersion(RegistryError):
    """A rollback needs a version that was live before the current rollout; there is none."""
