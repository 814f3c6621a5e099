"""API keys: generation, salted hashing, constant-time verification.

A key looks like ``lmx_<prefix>_<secret>``: ``prefix`` (12 hex characters) is stored in
clear to find the row, the whole key only as ``pbkdf2_sha256$<iterations>$<salt>$<hash>``.
Keys carry 256 random bits, so the iteration count is modest: it guards against a leaked
table, not a guessable password.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "lmx"
PBKDF2_ITERATIONS = 20_000
_KEY_RE = re.compile(r"^lmx_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


def generate_key() -> tuple[str, str]:
    """A new plaintext key and its lookup prefix."""
    prefix = secrets.token_hex(6)
    return f"{KEY_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}", prefix


def key_prefix(key: str) -> str | None:
    """The lookup prefix of a well-formed key, else ``None``."""
    m = _KEY_RE.match(key or "")
    return m.group(1) if m else None


def hash_key(key: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS) -> str:
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.pbkdf2_hmac("sha256", key.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def verify_key(key: str, stored: str) -> bool:
    """Constant-time check of ``key`` against a stored hash."""
    try:
        scheme, iterations, salt, digest = stored.split("$")
        if scheme != "pbkdf2_sha256":
            return False
        got = hashlib.pbkdf2_hmac("sha256", key.encode(), bytes.fromhex(salt), int(iterations))
    except ValueError:
        return False
    return hmac.compare_digest(got.hex(), digest)


_DUMMY_HASH = hash_key("lmx_000000000000_" + "0" * 43)


def burn_time(key: str) -> None:
    """Spend the time of one verification, so an unknown prefix answers as slowly."""
    verify_key(key, _DUMMY_HASH)
