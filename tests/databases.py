"""Scratch databases for tests: created, migrated, and dropped afterwards."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg

from kiln.ledger.migrate import sync_url, upgrade


@contextlib.contextmanager
def scratch_database(server_url: str, prefix: str = "kiln_test") -> Iterator[str]:
    """A new migrated database on the server of ``server_url`` (any database URL of it);
    yields its URL and drops it (even while connections are open) on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sync_url(server_url).replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = server_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
