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
