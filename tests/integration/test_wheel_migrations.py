"""The wheel carries the ledger's migrations: built from this checkout, unpacked alone (no
checkout beside it), its ``kiln.ledger.migrate`` finds its own Alembic scripts and migrates a
fresh PostgreSQL database to head."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _wheel(out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(REPO)],
        check=True, timeout=240, capture_output=True,
    )  # fmt: skip
    (wheel,) = out.glob("kiln-*.whl")
    return wheel


def test_a_wheel_install_migrates_with_its_own_scripts(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "dist")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kiln/ledger/migrations/env.py" in names
    assert "kiln/ledger/migrations/script.py.mako" in names
    versions = sorted(n for n in names if n.startswith("kiln/ledger/migrations/versions/"))
    shipped = sorted(
        f"kiln/ledger/migrations/versions/{p.name}"
        for p in (REPO / "services/kiln/ledger/migrations/versions").glob("*.py")
    )
    assert versions == shipped and shipped
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)

    db = f"kiln_wheel_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{db}"'))
    try:
        url = f"postgresql://postgres@127.0.0.1:5432/{db}"
        script = (
            "import sys; from kiln.ledger import migrate; "
            "print(migrate.migrations_dir()); migrate.upgrade(sys.argv[1])"
        )
        env = {
            k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KILN_MIGRATIONS_DIR")
        }
        env["PYTHONPATH"] = str(site)
        done = subprocess.run(
            [sys.executable, "-c", script, url], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[0] == str(site / "kiln/ledger/migrations")
        engine = sa.create_engine(f"postgresql+psycopg://postgres@127.0.0.1:5432/{db}")
        with engine.connect() as conn:
            tables = set(sa.inspect(conn).get_table_names())
        engine.dispose()
        assert {"events", "outbox", "alembic_version"} <= tables
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()
