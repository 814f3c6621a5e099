"""Alembic environment for the loramux registry.

The database comes from, in order: a connection handed over by
``loramux.registry.db.Database`` (``config.attributes["connection"]``), the
``sqlalchemy.url`` option, the service's ``database_url`` setting (``Settings``, the
one reader of ``LORAMUX_*`` variables), or the embedded SQLite file in the data dir.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from loramux.registry.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from loramux.platform.settings import Settings

    url = Settings().database_url
    if url:
        return url
    from loramux.registry.factory import default_database_url

    return default_database_url()


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
