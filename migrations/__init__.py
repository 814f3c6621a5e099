"""Alembic migrations of the loramux registry schema (``loramux.migrations``).

Run them with ``loramux db upgrade`` (any working directory), from Python with
``loramux.registry.db.Database(url).upgrade()``, or with ``alembic`` from the repository
root (``alembic.ini`` there points here).
"""
