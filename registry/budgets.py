"""How long the registry may wait on its dependencies (the database and the object store).

Every field is also a ``loramux serve`` flag and a ``LORAMUX_*`` variable (the platform's
``Settings`` generates them from this dataclass): the defaults live here only. A stalled
dependency must cost a request seconds, not minutes: botocore's own defaults are 60 s
reads and 5 attempts, and a database connection has no timeout at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DependencyBudgets:
    """Timeouts and retry budgets of the database and the object store."""

    s3_connect_timeout: float = field(default=2.0, metadata={"doc": (
        "Seconds to open a connection to the object store.")})
    s3_read_timeout: float = field(default=5.0, metadata={"doc": (
        "Seconds the object store may stay silent on an open connection (per read).")})
    s3_max_attempts: int = field(default=2, metadata={"doc": (
        "Attempts of one object-store call, the first included (botocore's retry budget).")})
    db_connect_timeout: float = field(default=3.0, metadata={"doc": (
        "Seconds to open a database connection (PostgreSQL).")})
    db_statement_timeout: float = field(default=5.0, metadata={"doc": (
        "Seconds one SQL statement may run or wait for a lock on the server (PostgreSQL "
        "statement_timeout and lock_timeout).")})
    db_pool_timeout: float = field(default=3.0, metadata={"doc": (
        "Seconds to wait for a free connection of the database pool.")})
    db_pool_size: int = field(default=8, metadata={"doc": (
        "Connections kept in the database pool (and as many again in overflow).")})

    def __post_init__(self) -> None:
        for name in ("s3_connect_timeout", "s3_read_timeout", "db_connect_timeout",
                     "db_statement_timeout", "db_pool_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if self.s3_max_attempts < 1 or self.db_pool_size < 1:
            raise ValueError("s3_max_attempts and db_pool_size must be at least 1")
