"""External services in tests (PostgreSQL, Redis, S3): skip when one is absent, except
under ``CI=true``, where absence is a failure."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def require_service(available: bool, what: str) -> None:
    """Skip when a service is absent, except under CI=true where absence is a failure."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required under CI=true but is not reachable")
    pytest.skip(f"{what} is not reachable")
