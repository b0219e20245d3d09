"""The embedded PostgreSQL asks every connection for the superuser's password: a real server,
real connections over TCP and its Unix socket, as root and as uid 65534 (a forked child); a data
directory an older kiln made with ``trust`` is upgraded in place; private file modes."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from kiln.embedded import postgres_auth as auth
from kiln.embedded.postgres import EmbeddedPostgres, free_port

pytestmark = pytest.mark.embedded

NOBODY = 65534


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(tmp_path / "pg", port=free_port())
    try:
        yield pg
    finally:
        pg.stop()


def _connect(pg: EmbeddedPostgres, password: str | None, *, socket: bool = False) -> str:
    """ "ok" when a connection as the superuser succeeds, else the server's (or libpq's) reason.
    ``password`` None = none given (and no password file consulted)."""
    host = str(pg.data_dir) if socket else "127.0.0.1"
    try:
        with psycopg.connect(
            host=host, port=pg.port, user="postgres", dbname="kiln",
            password=password or "", passfile=os.devnull, connect_timeout=5,
        ) as conn:  # fmt: skip
            conn.execute("SELECT 1")
        return "ok"
    except psycopg.OperationalError as exc:
        return str(exc).strip()


def _as_nobody(probe: Callable[[], str]) -> str:
    """``probe()``'s answer as computed by a forked child that became uid/gid 65534."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            answer = probe()
        except BaseException as exc:  # report anything, then leave at once
            answer, code = f"child failed: {exc!r}", 1
        os.write(write, answer.encode()[:4000])
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _refused(answer: str) -> bool:
    return answer != "ok" and "password" in answer.lower()


def test_no_connection_without_the_password(postgres: EmbeddedPostgres) -> None:
    url = postgres.start()
    password = postgres.password.read()
    assert password and f":{password}@" in url
    assert _connect(postgres, password) == "ok"
    assert _connect(postgres, password, socket=True) == "ok"
    assert _refused(_connect(postgres, None)), "TCP without a password"
    assert _refused(_connect(postgres, None, socket=True)), "socket without a password"
    assert "password authentication failed" in _connect(postgres, "wrong")
    assert auth.hba_is_ours(postgres.hba_file)
    assert "trust" not in postgres.hba_file.read_text()

    # the private files: credentials outside PGDATA, the server's log in it
    assert postgres.password.directory.parent == postgres.data_dir.parent
    assert _mode(postgres.password.directory) == 0o700
    assert _mode(postgres.password.path) == 0o600
    assert _mode(postgres.data_dir) == 0o700
    assert _mode(postgres.log_path) == 0o600

    if os.geteuid() != 0:
        return  # uid 65534 needs root to become
    assert _refused(_as_nobody(lambda: _connect(postgres, None))), "uid 65534 over TCP"
    over_socket = _as_nobody(lambda: _connect(postgres, None, socket=True))
    assert over_socket != "ok", "uid 65534 over the socket"  # the 0700 PGDATA holds it

    def read_password() -> str:
        try:
            return postgres.password.path.read_text()
        except PermissionError as exc:
            return f"refused: {exc.strerror}"

    assert _as_nobody(read_password).startswith("refused"), "uid 65534 read the password"


def _initdb_with_trust(pg: EmbeddedPostgres) -> None:
    """A data directory as kiln before password authentication made it."""
    user = pg._prepare()
    args = ["-D", str(pg.data_dir), "-U", "postgres", "--auth=trust", "--encoding=UTF8"]
    assert pg._run("initdb", [*args, "--no-instructions"], user, timeout_s=120) is None


@pytest.mark.parametrize("running", [True, False], ids=["running", "stopped"])
def test_a_trust_data_directory_is_upgraded_in_place(
    postgres: EmbeddedPostgres, monkeypatch: pytest.MonkeyPatch, running: bool
) -> None:
    """`kiln up` on a state directory an older kiln made: with its server still running
    (started the old way, trusting everyone) or stopped, the data is kept and from then on
    nothing connects without the password."""
    _initdb_with_trust(postgres)
    with monkeypatch.context() as old_kiln:
        old_kiln.setattr(postgres, "_require_password", lambda password: None)
        postgres.start()
    assert _connect(postgres, None) == "ok"  # trust: anyone is the superuser
    with psycopg.connect(
        host="127.0.0.1", port=postgres.port, user="postgres", dbname="kiln", autocommit=True
    ) as conn:
        conn.execute("CREATE TABLE kept (x int)")
        conn.execute("INSERT INTO kept VALUES (7)")
    if not running:
        postgres.stop()

    upgraded = EmbeddedPostgres(postgres.data_dir, port=postgres.port)
    url = upgraded.start()
    password = upgraded.password.read()
    assert password and f":{password}@" in url
    assert _refused(_connect(upgraded, None)), "TCP without a password"
    assert _refused(_connect(upgraded, None, socket=True)), "socket without a password"
    assert auth.hba_is_ours(upgraded.hba_file) and _mode(upgraded.hba_file) == 0o600
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT x FROM kept").fetchall() == [(7,)]


def test_a_lost_password_is_a_clear_error(postgres: EmbeddedPostgres) -> None:
    postgres.start()
    postgres.password.path.write_text("not-the-password\n")
    with pytest.raises(
        RuntimeError, match=r"refuses the password in .*-credentials/postgres: restore"
    ):
        EmbeddedPostgres(postgres.data_dir, port=postgres.port).start()
