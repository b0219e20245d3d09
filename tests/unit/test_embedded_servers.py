"""The embedded PostgreSQL and NATS: start, reuse, stop, restart with data kept, clear errors."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from kiln.embedded.nats import EmbeddedNats, jetstream_answers
from kiln.embedded.postgres import EmbeddedPostgres, free_port

pytestmark = pytest.mark.embedded


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port something else already listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.fixture
def postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(tmp_path / "pg", port=free_port())
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "nats", port=free_port())
    try:
        yield server
    finally:
        server.stop()


def _plain(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_postgres_start_is_idempotent_and_restart_keeps_data(postgres: EmbeddedPostgres) -> None:
    url = postgres.start()
    password = postgres.password.read()
    assert (
        password
        and url == f"postgresql+psycopg://postgres:{password}@127.0.0.1:{postgres.port}/kiln"
    )
    pid = postgres.pid
    assert pid is not None and postgres.is_running()
    assert postgres.start() == url and postgres.pid == pid  # reused, not restarted

    with psycopg.connect(_plain(url), autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (x int)")
        conn.execute("INSERT INTO kept VALUES (42)")

    postgres.stop()
    assert not postgres.is_running()
    postgres.stop()  # stopping a stopped server is fine

    assert postgres.start() == url
    with psycopg.connect(_plain(url)) as conn:
        assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]


def test_postgres_adopts_the_running_servers_port(postgres: EmbeddedPostgres) -> None:
    url = postgres.start()
    other = EmbeddedPostgres(postgres.data_dir, port=1)
    assert other.start() == url
    assert other.port == postgres.port


def test_postgres_port_in_use_is_a_clear_error(tmp_path: Path, listening_port: int) -> None:
    pg = EmbeddedPostgres(tmp_path / "pg", port=listening_port)
    try:
        with pytest.raises(RuntimeError, match="Address already in use") as info:
            pg.start()
        assert f"127.0.0.1:{listening_port}" in str(info.value)
        assert not pg.is_running()
    finally:
        pg.stop()


def test_nats_start_is_idempotent_and_restart_keeps_jetstream(nats_server: EmbeddedNats) -> None:
    import nats

    url = nats_server.start()
    assert url == f"nats://127.0.0.1:{nats_server.port}"
    pid = nats_server.pid
    assert pid is not None
    assert nats_server.start() == url and nats_server.pid == pid
    assert jetstream_answers(url)

    async def publish() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream()
        await js.add_stream(name="KEPT", subjects=["kept.>"])
        await js.publish("kept.one", b"hello")
        await nc.close()

    async def count() -> int:
        nc = await nats.connect(url)
        info = await nc.jetstream().stream_info("KEPT")
        await nc.close()
        return int(info.state.messages)

    asyncio.run(publish())
    nats_server.stop()
    assert not nats_server.is_running()
    assert not jetstream_answers(url)

    nats_server.start()
    assert asyncio.run(count()) == 1


def test_nats_port_in_use_is_a_clear_error(tmp_path: Path, listening_port: int) -> None:
    server = EmbeddedNats(tmp_path / "nats", port=listening_port)
    try:
        with pytest.raises(RuntimeError, match="address already in use"):
            server.start()
        assert not server.is_running()
    finally:
        server.stop()


def test_nats_ignores_a_stale_pid_file(nats_server: EmbeddedNats) -> None:
    nats_server.data_dir.mkdir(parents=True)
    nats_server.pid_file.write_text(f"{os.getpid()}\n")  # alive, but not a nats-server
    assert not nats_server.is_running()
    nats_server.start()
    assert nats_server.pid not in (None, os.getpid())
