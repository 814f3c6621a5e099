"""``Authorization: Bearer <key>`` → caller. Tenant keys live hashed in the registry;
the admin key is either ``settings.admin_key`` or a registry key marked admin.

Successful lookups are cached for ``ttl`` seconds under the key's sha256 (the
registry's PBKDF2 check costs milliseconds, too much for every request); the
registry's ``key_revoked`` event empties the cache, so a revocation is immediate.

Behind gateways (``--role engine``) :class:`GatewayIdentityAuthenticator` takes the caller
from the gateway's signed identity instead of a client key.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from loramux.platform.bulkheads import Dependencies
from loramux.platform.cluster.protocol import read_identity
from loramux.platform.errors import Forbidden, Unauthorized
from loramux.platform.identity import Caller
from loramux.platform.ttl_cache import TTLCache

if TYPE_CHECKING:
    from loramux.registry.service import RegistryService

_CHALLENGE = {"WWW-Authenticate": "Bearer"}
KEY_CACHE_TTL_S = 10.0
"""Seconds a key's caller is cached (a revocation empties the cache at once)."""


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, else None."""
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


class Authenticator:
    """Maps API keys to callers."""

    def __init__(self, registry: RegistryService | None, *, admin_key: str | None, allow_anonymous: bool,
                 ttl: float = KEY_CACHE_TTL_S, deps: Dependencies | None = None) -> None:
        """``deps``: the database bulkhead the key lookups run in; while the database is
        down a key seen before keeps working for ``outage_staleness`` seconds."""
        self.registry = registry
        self._admin_digest = hashlib.sha256(admin_key.encode()).digest() if admin_key else None
        self.allow_anonymous = allow_anonymous
        self.ttl = ttl
        self.deps = deps or Dependencies()
        self._cache: TTLCache[bytes, Caller] = self.deps.stale_cache(ttl, cache_none=False)

    def _lookup(self, key: str, digest: bytes) -> Caller | None:
        """Blocking: the admin key, else the registry (PBKDF2 + SQL)."""
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return Caller(None, is_admin=True)
        if self.registry is not None:
            row = self.registry.authenticate_key(key)
            if row is not None:
                return Caller(row.tenant, is_admin=bool(row.is_admin), key_prefix=row.prefix)
        return None

    async def lookup(self, key: str | None) -> Caller | None:
        """The caller a key belongs to (cache first, else the database bulkhead), or None."""
        if key is None:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return Caller(None, is_admin=True)  # needs no database
        return await self.deps.read_through(
            self._cache, digest, lambda: self.deps.db.call(self._lookup, key, digest))

    def forget(self) -> None:
        """Drop every cached key (a revoked key is refused from the next request on)."""
        self._cache.clear()

    def on_registry_event(self, kind: str, handle: object) -> None:
        """Registry listener: a revoked key takes effect at once."""
        if kind == "key_revoked":
            self.forget()

    async def caller(self, authorization: str | None) -> Caller:
        """The caller of an inference request (anonymous when allowed)."""
        key = bearer_key(authorization)
        if key is not None:
            caller = await self.lookup(key)
            if caller is not None:
                return caller
            if self.allow_anonymous:
                return Caller(None)
            raise Unauthorized("Incorrect API key provided.", headers=_CHALLENGE)
        if self.allow_anonymous:
            return Caller(None)
        raise Unauthorized(
            "Missing API key: send the header `Authorization: Bearer <key>`.", headers=_CHALLENGE
        )

    async def tenant(self, authorization: str | None) -> Caller:
        """A caller that is a tenant (the adapter API needs one)."""
        caller = await self.lookup(bearer_key(authorization))
        if caller is None or caller.tenant is None:
            raise Unauthorized(
                "a tenant API key is required: send `Authorization: Bearer <key>`",
                headers=_CHALLENGE,
            )
        return caller

    async def admin(self, authorization: str | None) -> Caller:
        """The admin: 401 without a valid key, 403 for a valid key that is not the admin's."""
        caller = await self.lookup(bearer_key(authorization))
        if caller is None:
            raise Unauthorized("the admin key is required", headers=_CHALLENGE)
        if not caller.is_admin:
            raise Forbidden("this key is not the admin key")
        return caller


class GatewayIdentityAuthenticator(Authenticator):
    """Engine role: the caller is whoever the gateway vouched for with :func:`identity_token`.
    Tenants are looked up by id (cached ``ttl`` seconds); anything else is no caller."""

    def __init__(self, registry, secret: str, *, allow_anonymous: bool,
                 ttl: float = KEY_CACHE_TTL_S, deps: Dependencies | None = None):
        super().__init__(registry, admin_key=None, allow_anonymous=allow_anonymous, ttl=ttl,
                         deps=deps)
        self.secret = secret
        self._tenants: TTLCache[int, object] = self.deps.stale_cache(ttl)

    async def lookup(self, key: str | None) -> Caller | None:
        identity = read_identity(self.secret, key)
        if identity is None:
            return None
        tid, is_admin, key_prefix = identity
        if tid is None:
            return Caller(None, is_admin=is_admin)
        if self.registry is None:
            return None
        try:  # a database outage is the error table's 503, not "no caller"
            tenant = await self.deps.read_through(
                self._tenants, tid, lambda: self.deps.db.call(self.registry.get_tenant, tid))
        except LookupError:  # a deleted tenant (TenantNotFound)
            return None
        return Caller(tenant, is_admin=is_admin, key_prefix=key_prefix)

    def forget(self) -> None:
        super().forget()
        self._tenants.clear()
