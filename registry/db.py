"""The database handle: engine, sessions, and Alembic migrations run from Python.

SQLite (the embedded default) gets WAL journaling, foreign keys and a busy timeout;
PostgreSQL gets a connect timeout, a server-side ``statement_timeout`` and a bounded
pool wait (:class:`~loramux.registry.budgets.DependencyBudgets`), so a database that
stops answering costs a caller seconds, not minutes (migrations run without the
statement timeout). The schema comes from Alembic (``upgrade()``), never from
``create_all`` outside tests.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from loramux.registry.budgets import DependencyBudgets
from loramux.registry.errors import SchemaOutOfDate


def migrations_dir() -> Path:
    """The Alembic script folder: the installed ``loramux.migrations`` package, else the
    ``migrations/`` folder beside this package in a source checkout."""
    try:
        spec = importlib.util.find_spec("loramux.migrations")
    except ModuleNotFoundError:
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            if (Path(location) / "env.py").is_file():
                return Path(location)
    here = Path(__file__).resolve().parent.parent / "migrations"
    if (here / "env.py").is_file():
        return here
    raise RuntimeError("the loramux migrations folder is missing from this installation")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()


def _postgres_args(url: URL, b: DependencyBudgets) -> dict[str, Any]:
    """libpq's connect timeout (whole seconds, at least 1) and the server-side statement
    timeout, added to any ``options`` the URL already carries (a test's search_path)."""
    timeout_ms = int(b.db_statement_timeout * 1000)
    options = " ".join(filter(None, [
        url.query.get("options") if isinstance(url.query.get("options"), str) else None,
        f"-c statement_timeout={timeout_ms}", f"-c lock_timeout={timeout_ms}",
    ]))
    return {"connect_timeout": max(1, round(b.db_connect_timeout)), "options": options}


class Database:
    """Engine + sessionmaker for one database URL.

    ``session()`` is a unit of work: it commits when the block ends and rolls back on
    an exception.
    """

    def __init__(self, url: str | URL, *, echo: bool = False,
                 budgets: DependencyBudgets | None = None) -> None:
        self.url = make_url(url)
        self.budgets = b = budgets or DependencyBudgets()
        kwargs: dict[str, Any] = {"echo": echo}
        if self.is_sqlite:
            # SQLite is a local file: it never stalls on a network, only waits for the
            # write lock, which concurrent uploads hold briefly (30 s as before).
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            if self.url.database in (None, "", ":memory:"):
                kwargs["poolclass"] = StaticPool
            else:
                Path(self.url.database).parent.mkdir(parents=True, exist_ok=True)
        else:
            kwargs.update(pool_pre_ping=True, pool_size=b.db_pool_size,
                          max_overflow=b.db_pool_size, pool_timeout=b.db_pool_timeout)
            if self.url.get_backend_name() == "postgresql":
                kwargs["connect_args"] = _postgres_args(self.url, b)
        self.engine: Engine = create_engine(self.url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self.sessionmaker = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.url.get_backend_name() == "sqlite"

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: commit on success, roll back on error."""
        with self.sessionmaker() as session, session.begin():
            yield session

    def ping(self) -> None:
        """One round trip (``SELECT 1``); raises when the database does not answer."""
        with self.engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")

    def dispose(self) -> None:
        self.engine.dispose()

    # -- migrations -------------------------------------------------------------------

    def alembic_config(self):
        """An Alembic ``Config`` pointing at the bundled migrations and this database."""
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(migrations_dir()))
        cfg.set_main_option(
            "sqlalchemy.url", self.url.render_as_string(hide_password=False).replace("%", "%%")
        )
        return cfg

    def _run(self, fn, *args: Any) -> None:
        cfg = self.alembic_config()
        with self.engine.begin() as connection:
            if self.url.get_backend_name() == "postgresql":  # a migration may take long
                connection.exec_driver_sql("SET LOCAL statement_timeout = 0")
                connection.exec_driver_sql("SET LOCAL lock_timeout = 0")
            cfg.attributes["connection"] = connection
            fn(cfg, *args)

    def upgrade(self, revision: str = "head") -> None:
        """Apply migrations up to ``revision``. Called by ``loramux db upgrade`` and, for the
        embedded SQLite default, by ``build_registry``."""
        from alembic import command

        self._run(command.upgrade, revision)

    def downgrade(self, revision: str) -> None:
        """Revert migrations down to ``revision`` (``"base"`` empties the schema)."""
        from alembic import command

        self._run(command.downgrade, revision)

    def current_revision(self) -> str | None:
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()

    def head_revision(self) -> str | None:
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(self.alembic_config()).get_current_head()

    def check_schema(self) -> None:
        """Raise :class:`SchemaOutOfDate` unless the schema is at head."""
        current, head = self.current_revision(), self.head_revision()
        if current != head:
            raise SchemaOutOfDate(
                f"the database schema is at revision {current or 'none (empty database)'} but "
                f"this loramux needs {head}: run `loramux db upgrade`"
            )
