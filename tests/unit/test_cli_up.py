"""What ``kiln up`` / ``kiln down`` / ``kiln status`` do under the hood (the Supervisor): the
state directory's lock, one SIGTERM per service on ``down``, and a status that reports only
what this state directory's ``up`` started, probing it for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kiln.common.settings import KilnSettings
from kiln.embedded.endpoints import Endpoints
from kiln.embedded.lock import StateDirBusy, state_lock
from kiln.embedded.postgres import free_port
from kiln.embedded.services import (
    failure_summary,
    last_run_lines,
    service_env,
    supervisor_line,
)
from kiln.embedded.supervisor import ComponentStatus, Supervisor

# A stand-in for `kiln serve NAME` (its command line carries the marker the supervisor looks
# for): counts the SIGTERMs it gets, takes `delay` seconds to shut down after the first one,
# or ignores them when `delay` is negative.
_FAKE_SERVICE = """
import signal, sys, time
out, delay = sys.argv[1], float(sys.argv[2])
stopping = []
def on_term(signum, frame):
    with open(out, "a") as f:
        f.write("TERM\\n")
    stopping.append(time.monotonic())
signal.signal(signal.SIGTERM, on_term)
open(out, "a").close()
while not stopping or delay < 0 or time.monotonic() - stopping[0] < delay:
    time.sleep(0.02)
"""


def _settings(state_dir: Path, **extra: object) -> KilnSettings:
    ports = {
        "embedded_postgres_port": free_port(),
        "embedded_nats_port": free_port(),
        **{f"{n}_addr": f"127.0.0.1:{free_port()}" for n in ("ledger", "engine_pool")},
        **{f"{n}_addr": f"127.0.0.1:{free_port()}" for n in ("agent_runner", "cost_model")},
    }
    ports.update(extra)
    return KilnSettings(state_dir=state_dir, **ports)  # type: ignore[arg-type]


def _fake_service(state_dir: Path, name: str, delay: float) -> tuple[subprocess.Popen[bytes], Path]:
    out = state_dir / f"{name}.terms"
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVICE, str(out), str(delay), "kiln", "serve", name]
    )
    (state_dir / "run").mkdir(parents=True, exist_ok=True)
    (state_dir / "run" / f"{name}.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:  # its handler is installed
        time.sleep(0.02)
    return proc, out


# ------------------------------------------------------------------------------ the lock
def test_state_lock_is_exclusive_and_names_the_holder(tmp_path: Path) -> None:
    with state_lock(tmp_path):
        assert (tmp_path / "kiln.lock").read_text().strip() == str(os.getpid())
        started = time.monotonic()
        with pytest.raises(StateDirBusy) as info, state_lock(tmp_path, wait_s=0.3):
            pass
        assert time.monotonic() - started >= 0.3
        assert str(info.value) == (
            f"another kiln up/down is running for {tmp_path} (pid {os.getpid()})"
        )
    with state_lock(tmp_path, wait_s=0):  # released
        pass


def test_up_and_down_take_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kiln.embedded.lock.LOCK_WAIT_S", 0.1)
    supervisor = Supervisor(_settings(tmp_path))
    with state_lock(tmp_path):
        with pytest.raises(StateDirBusy):
            supervisor.up()
        with pytest.raises(StateDirBusy):
            supervisor.down()
    assert not (tmp_path / "postgres").exists()


def test_down_of_a_missing_state_dir_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "never"
    assert Supervisor(_settings(missing)).down() == []
    assert not missing.exists()


# --------------------------------------------------------------------------------- down
def test_down_signals_each_service_once(tmp_path: Path) -> None:
    procs = {name: _fake_service(tmp_path, name, delay=0.5) for name in ("ledger", "cost-model")}
    stopped = Supervisor(_settings(tmp_path)).down()
    assert stopped == ["ledger", "cost-model"]
    for proc, terms in procs.values():
        assert proc.wait(timeout=5) == 0  # exited by itself: no SIGKILL
        assert terms.read_text().splitlines() == ["TERM"]
    assert not list((tmp_path / "run").glob("*.pid"))


def test_down_kills_a_service_only_after_the_grace_period(tmp_path: Path) -> None:
    proc, terms = _fake_service(tmp_path, "engine-pool", delay=-1)  # ignores SIGTERM
    started = time.monotonic()
    assert Supervisor(_settings(tmp_path, grace_period_s=0.0)).down() == ["engine-pool"]
    assert time.monotonic() - started >= 5.0  # grace_period_s + 5
    assert proc.wait(timeout=5) == -9
    assert terms.read_text().splitlines() == ["TERM"]


# ------------------------------------------------------------------------------- status
@pytest.fixture
def foreign_grpc_server() -> Iterator[str]:
    """A gRPC server, not started by any state dir, whose health says SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def _rows(supervisor: Supervisor) -> dict[str, ComponentStatus]:
    return {row.name: row for row in supervisor.status()}


def test_status_never_calls_a_foreign_server_healthy(
    tmp_path: Path, foreign_grpc_server: str
) -> None:
    state_dir = tmp_path / "nonexistent" / "x"
    rows = _rows(Supervisor(_settings(state_dir, ledger_addr=foreign_grpc_server)))
    ledger = rows["ledger"]
    assert not ledger.healthy and ledger.pid is None
    assert ledger.note == f"not running (something else answers at {foreign_grpc_server})"
    assert not any(row.healthy for row in rows.values())
    assert not state_dir.exists()


def test_status_reads_what_up_recorded_not_the_environment(tmp_path: Path) -> None:
    """endpoints.json says both servers are embedded: URLs set in the current shell (garbage
    here) change nothing; the servers are not running, so they say so."""
    Endpoints(
        nats_url="nats://127.0.0.1:1",
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/kiln",
        embedded={"postgres": True, "nats": True},
        services={},
    ).write(tmp_path / "endpoints.json")
    settings = _settings(tmp_path, nats_url="garbage", database_url="postgresql://x@nowhere/y")
    rows = _rows(Supervisor(settings))
    for name in ("postgres", "nats"):
        assert not rows[name].healthy
        assert rows[name].note == "not running", rows[name]


def test_status_probes_recorded_external_servers(tmp_path: Path) -> None:
    Endpoints(
        nats_url="garbage",
        database_url=f"postgresql+psycopg://postgres:secret@127.0.0.1:{free_port()}/kiln",
        embedded={"postgres": False, "nats": False},
        services={"ledger": "127.0.0.1:1"},
    ).write(tmp_path / "endpoints.json")
    rows = _rows(Supervisor(_settings(tmp_path)))
    assert not rows["nats"].healthy and rows["nats"].note.startswith("external: invalid URL")
    assert not rows["postgres"].healthy
    assert rows["postgres"].note.startswith("external: cannot connect")
    assert "secret" not in rows["postgres"].address
    assert rows["ledger"].address == "127.0.0.1:1"  # the recorded one


@pytest.mark.integration
def test_status_of_reachable_external_servers(
    tmp_path: Path, database_url: str, nats_url: str
) -> None:
    Endpoints(
        nats_url=nats_url,
        database_url=database_url,
        embedded={"postgres": False, "nats": False},
    ).write(tmp_path / "endpoints.json")
    rows = _rows(Supervisor(_settings(tmp_path)))
    assert rows["postgres"].healthy and rows["postgres"].note == "external"
    assert rows["nats"].healthy and rows["nats"].note == "external"


# ------------------------------------------------------------------------ service logs
def test_supervisor_lines_are_json_and_mark_each_run() -> None:
    first = supervisor_line("ledger", "starting service", addr="127.0.0.1:1")
    record = json.loads(first)
    assert record["logger"] == "kiln.supervisor" and record["service"] == "ledger"
    assert record["timestamp"].endswith("Z")
    failed = json.dumps({"level": "error", "event": "service failed", "error": "old"})
    second = supervisor_line("ledger", "starting service", addr="127.0.0.1:1")
    now_failed = json.dumps({"level": "error", "event": "service failed", "error": "new"})
    log = first + failed + "\n" + second + "E1130 07:27:09 add_port.cc:83] noise\n" + now_failed
    lines = last_run_lines(log)
    assert lines[0].startswith("E1130") and len(lines) == 2
    assert failure_summary(lines) == "new"
    assert failure_summary(["just text"]) is None


def test_service_env_drops_the_shared_listen_address() -> None:
    env = service_env({"KILN_LISTEN_ADDR": "0.0.0.0:1", "PATH": "/bin"}, {"KILN_TEAM": "t"})
    assert "KILN_LISTEN_ADDR" not in env and env["KILN_TEAM"] == "t"


# ------------------------------------------------------------------ ports taken on `up`
def test_up_refuses_one_metrics_port_for_four_services(tmp_path: Path) -> None:
    supervisor = Supervisor(_settings(tmp_path, metrics_port=9500))
    problems = supervisor._metrics_conflicts(list(supervisor.services.values()))
    assert problems == [
        "KILN_METRICS_PORT=9500 would give all four services the same metrics port: unset it "
        "(they use 9401..9404) or set it to 0 (off)"
    ]
    off = Supervisor(_settings(tmp_path, metrics_port=0))
    assert off._metrics_conflicts(list(off.services.values())) == []


def test_up_names_a_taken_default_metrics_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        monkeypatch.setattr("kiln.common.settings.METRICS_PORT_BASE", taken - 2)  # engine-pool's
        supervisor = Supervisor(_settings(tmp_path))
        problems = supervisor._metrics_conflicts(list(supervisor.services.values()))
    assert len(problems) == 1
    assert problems[0].startswith(f"engine-pool: metrics port {taken} is already in use")
    assert "KILN_METRICS_PORT=0" in problems[0]
