"""Password authentication of the embedded PostgreSQL: the superuser's password and the
``pg_hba.conf`` that requires it on every connection type.

``kiln up`` generates the password once (32 random bytes, hex) into
``KILN_STATE_DIR/postgres-credentials/postgres`` (directory 0700, file 0600, outside PGDATA,
which ``initdb`` needs empty); the URL kiln records in ``endpoints.json`` (0600) carries it.
:data:`HBA` admits nobody without it: no ``trust``, no ``peer``. Why and what stays open:
docs/design/security.md, "PostgreSQL".
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Final
from urllib.parse import quote

from kiln.embedded.private import FILE_MODE, private_dir, write_private

SUPERUSER: Final = "postgres"
"""The role kiln connects as (``initdb -U``)."""

METHOD: Final = "scram-sha-256"

HBA: Final = (
    "# Written by `kiln up` (kiln.embedded.postgres_auth); rewritten when it differs.\n"
    "# TYPE  DATABASE     USER  ADDRESS       METHOD\n"
    f"local   all          all                 {METHOD}\n"
    f"host    all          all   127.0.0.1/32  {METHOD}\n"
    f"host    all          all   ::1/128       {METHOD}\n"
    f"local   replication  all                 {METHOD}\n"
    f"host    replication  all   127.0.0.1/32  {METHOD}\n"
    f"host    replication  all   ::1/128       {METHOD}\n"
)
"""The whole ``pg_hba.conf`` of the embedded server: a password on the Unix socket and on
TCP (the server listens on 127.0.0.1 only)."""


class PostgresPassword:
    """The superuser's password in ``directory/postgres`` (directory 0700, file 0600)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @property
    def path(self) -> Path:
        """The file holding the password (one line)."""
        return self.directory / SUPERUSER

    def read(self) -> str | None:
        """The password, or None when the file is missing, empty or unreadable by us (another
        user's ``kiln status`` reads no secret)."""
        try:
            return self.path.read_text().strip() or None
        except OSError:
            return None

    def ensure(self) -> str:
        """The password, generated on first use; narrows the modes an older kiln left."""
        private_dir(self.directory)
        found = self.read()
        if found is None:
            found = secrets.token_hex(32)
            write_private(self.path, found + "\n")
        self.path.chmod(FILE_MODE)
        return found


def url(port: int, database: str, password: str | None) -> str:
    """SQLAlchemy URL of ``database`` on 127.0.0.1:``port`` as the superuser, with
    ``password`` (percent-encoded) when given."""
    secret = f":{quote(password, safe='')}" if password else ""
    return f"postgresql+psycopg://{SUPERUSER}{secret}@127.0.0.1:{port}/{database}"


def hba_is_ours(hba_file: Path) -> bool:
    """True when ``hba_file`` is :data:`HBA` (False when missing or different: an older kiln's
    ``trust``, or an edit)."""
    try:
        return hba_file.read_text() == HBA
    except OSError:
        return False
