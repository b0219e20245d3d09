"""``kiln up`` / ``kiln down`` as a user runs them: the real CLI in subprocesses, the embedded
NATS and PostgreSQL, the four services as processes, data kept across a restart."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest

from kiln.embedded.endpoints import Endpoints
from kiln.embedded.nats import jetstream_answers
from kiln.embedded.process import process_alive, read_pid
from kiln.ledger.migrate import sync_url

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SERVICES = ("ledger", "engine-pool", "agent-runner", "cost-model")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once, so none repeats)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def _base_env(state_dir: Path) -> dict[str, str]:
    """This process's environment without KILN_* settings, plus private ports for everything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    pg, nats, *svc = _free_ports(6)
    env.update(
        KILN_STATE_DIR=str(state_dir),
        KILN_EMBEDDED_POSTGRES_PORT=str(pg),
        KILN_EMBEDDED_NATS_PORT=str(nats),
        KILN_METRICS_PORT="0",
        KILN_TEAM="e2e",
        COLUMNS="200",
    )
    for name, port in zip(SERVICES, svc, strict=True):
        env[f"KILN_{name.replace('-', '_').upper()}_ADDR"] = f"127.0.0.1:{port}"
    return env


def kiln(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the real ``kiln`` CLI."""
    result = subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    if check:
        assert result.returncode == 0, f"kiln {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture
def kiln_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for a private embedded default; ``kiln down`` runs afterwards, always."""
    env = _base_env(tmp_path / "state")
    try:
        yield env
    finally:
        kiln(env, "down", check=False)


def _pids(state_dir: Path) -> dict[str, int | None]:
    pids = {name: read_pid(state_dir / "run" / f"{name}.pid") for name in SERVICES}
    pids["postgres"] = read_pid(state_dir / "postgres" / "postmaster.pid")
    pids["nats"] = read_pid(state_dir / "nats" / "nats-server.pid")
    return pids


def _append_event(addr: str, stream: str) -> str:
    from kiln.ledger.client import LedgerClient
    from kiln.ledger.model import NewEvent

    event = NewEvent(
        "CompilationSubmitted",
        {
            "workload_key": "wk-e2e",
            "model_name": "tiny",
            "hardware": "cpu",
            "workload": {},
            "budget": {"wall_seconds": 60},
        },
    )

    async def go() -> None:
        client = LedgerClient(addr, "e2e")
        try:
            await client.append(stream, [event], "no_stream")
        finally:
            await client.close()

    asyncio.run(go())
    return event.event_id


def _stream_event_ids(env: dict[str, str], stream: str) -> list[str]:
    out = kiln(env, "ledger", "events", stream, "--json").stdout
    return [json.loads(line)["event_id"] for line in out.splitlines() if line.strip()]


@pytest.mark.embedded
def test_up_down_up_keeps_data(kiln_env: dict[str, str]) -> None:
    state_dir = Path(kiln_env["KILN_STATE_DIR"])

    first = kiln(kiln_env, "up")
    assert "started" in first.stdout
    status = kiln(kiln_env, "status")  # exits 0 only when every component is healthy
    for name in ("postgres", "nats", *SERVICES):
        assert name in status.stdout

    endpoints = Endpoints.read(state_dir / "endpoints.json")
    assert endpoints is not None
    assert endpoints.embedded == {"postgres": True, "nats": True}
    assert endpoints.services["ledger"] == kiln_env["KILN_LEDGER_ADDR"]
    with psycopg.connect(sync_url(endpoints.database_url).replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT to_regclass('events')").fetchone() == ("events",)
    assert jetstream_answers(endpoints.nats_url)

    again = kiln(kiln_env, "up")  # a no-op that reports what runs
    assert "already running" in again.stdout and "started" not in again.stdout

    stream = f"compilation-{uuid.uuid4().hex[:12]}"
    event_id = _append_event(kiln_env["KILN_LEDGER_ADDR"], stream)
    assert _stream_event_ids(kiln_env, stream) == [event_id]

    pids = _pids(state_dir)
    assert all(pids.values()), pids
    kiln(kiln_env, "down")
    for name, pid in pids.items():
        assert not process_alive(pid), f"{name} (pid {pid}) still runs after kiln down"
    assert kiln(kiln_env, "status", check=False).returncode == 3

    kiln(kiln_env, "up")
    assert _stream_event_ids(kiln_env, stream) == [event_id]
    tail = kiln(kiln_env, "ledger", "tail", "--no-follow", "--json").stdout
    assert event_id in tail
    replay = kiln(kiln_env, "ledger", "replay")
    assert "compilations" in replay.stdout
    kiln(kiln_env, "down")


@pytest.mark.embedded
def test_up_replaces_a_stale_service_pid_file(kiln_env: dict[str, str]) -> None:
    state_dir = Path(kiln_env["KILN_STATE_DIR"])
    (state_dir / "run").mkdir(parents=True)
    (state_dir / "run" / "ledger.pid").write_text(f"{os.getpid()}\n")  # alive, not a service
    kiln(kiln_env, "up")
    pid = read_pid(state_dir / "run" / "ledger.pid")
    assert pid != os.getpid() and process_alive(pid, "kiln serve ledger")


def test_up_uses_existing_servers(
    tmp_path: Path, postgres_server_url: str, nats_url: str, subject_prefix: str
) -> None:
    """With KILN_DATABASE_URL and KILN_NATS_URL set, `kiln up` starts no embedded server."""
    name = f"kiln_up_{uuid.uuid4().hex[:10]}"
    admin = sync_url(postgres_server_url).replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    env = _base_env(tmp_path / "state")
    env.update(
        KILN_DATABASE_URL=postgres_server_url.rsplit("/", 1)[0] + f"/{name}",
        KILN_NATS_URL=nats_url,
        KILN_SUBJECT_PREFIX=f"{subject_prefix}_up",
    )
    try:
        kiln(env, "up")
        assert not (tmp_path / "state" / "postgres").exists()
        assert not (tmp_path / "state" / "nats").exists()
        status = kiln(env, "status").stdout
        assert "external" in status
        with psycopg.connect(admin.rsplit("/", 1)[0] + f"/{name}") as conn:
            assert conn.execute("SELECT to_regclass('events')").fetchone() == ("events",)
    finally:
        kiln(env, "down", check=False)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
