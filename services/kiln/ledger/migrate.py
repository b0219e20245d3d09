"""Run the ledger's Alembic migrations programmatically (``kiln migrate``, ``kiln up``, tests)."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.config import Config


def sync_url(url: str) -> str:
    """The same database through the synchronous psycopg driver (Alembic runs sync)."""
    for prefix in ("postgresql+asyncpg://", "postgresql+psycopg_async://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def migrations_dir() -> Path:
    """The Alembic script directory: ``KILN_MIGRATIONS_DIR``, else the package's own
    ``kiln/ledger/migrations/`` (shipped in the wheel as package data).

    Raises FileNotFoundError when it holds no ``env.py``.
    """
    env = os.environ.get("KILN_MIGRATIONS_DIR")
    path = Path(env) if env else Path(__file__).resolve().parent / "migrations"
    if not (path / "env.py").is_file():
        raise FileNotFoundError(f"no Alembic migrations at {path}; set KILN_MIGRATIONS_DIR")
    return path


def alembic_config(database_url: str) -> Config:
    """An Alembic Config for the ledger's migrations on ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", sync_url(database_url).replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    """Migrate the database to ``revision`` (default: the newest). Safe to run repeatedly and
    from several processes at once (Alembic takes the version row in one transaction)."""
    command.upgrade(alembic_config(database_url), revision)


def current(database_url: str) -> str | None:
    """The database's current revision, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine, pool

    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
