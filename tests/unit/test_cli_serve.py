"""``kiln serve`` and ``kiln health`` against a real service process (the engine pool, which
needs neither PostgreSQL nor NATS), and the engine pool ``kiln serve`` assembles."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.baselines.in_engine import measure_baseline
from kiln.cli.serve import service_app
from kiln.common.apps import app_factory
from kiln.common.errors import FailedPrecondition
from kiln.common.settings import KilnSettings
from kiln.domain.candidate import Candidate
from kiln.embedded.postgres import free_port
from kiln.engine_pool.app import EnginePoolApp
from kiln.engine_pool.job import Job

from .engine_testing import work


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    # KILN_PKI_DIR stays: the session's certificates (tests/pki.py)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_PKI_DIR"}
    env.update(KILN_STATE_DIR=str(state_dir), KILN_METRICS_PORT="0", COLUMNS="200", **extra)
    return env


def _kiln(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def engine_pool(tmp_path: Path) -> Iterator[str]:
    """The address of a running ``kiln serve engine-pool``."""
    addr = f"127.0.0.1:{free_port()}"
    env = _env(tmp_path, KILN_ENGINE_POOL_ADDR=addr)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "serve", "engine-pool"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert _kiln(env, "health", addr, "--timeout", "30").returncode == 0
        yield addr
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_health_of_a_serving_service(tmp_path: Path, engine_pool: str) -> None:
    result = _kiln(_env(tmp_path), "health", engine_pool, "--service", "readiness")
    assert result.returncode == 0
    assert result.stdout.strip() == f"{engine_pool}: SERVING"


def test_health_of_an_unknown_service_name_fails_at_once(tmp_path: Path, engine_pool: str) -> None:
    started = time.monotonic()
    result = _kiln(_env(tmp_path), "health", engine_pool, "--service", "bogus", "--timeout", "20")
    assert time.monotonic() - started < 10  # not the whole --timeout
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: no health status for service 'bogus' at {engine_pool}"


def test_health_timeout_names_the_last_status_without_empty_details(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nothing listens
    result = _kiln(_env(tmp_path), "health", addr, "--timeout", "0.5")
    assert result.returncode == 1
    line = result.stderr.strip()
    assert line.startswith(f"error: {addr} is not healthy") and "last status: " in line
    assert not line.endswith(": ")


@pytest.fixture
def taken_addr() -> Iterator[str]:
    """An address something else already listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def test_port_in_use_names_the_services_own_address_variable(
    tmp_path: Path, taken_addr: str
) -> None:
    """Without --listen the address came from KILN_ENGINE_POOL_ADDR (what `kiln up` sets);
    the hint must name that variable, not KILN_LISTEN_ADDR."""
    result = _kiln(_env(tmp_path, KILN_ENGINE_POOL_ADDR=taken_addr), "serve", "engine-pool")
    assert result.returncode == 1
    errors = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    failed = [r for r in errors if r["level"] == "error"]
    assert len(failed) == 1, result.stderr
    message = failed[0]["error"]
    assert f"cannot listen on {taken_addr}" in message
    assert "KILN_ENGINE_POOL_ADDR" in message and "KILN_LISTEN_ADDR" not in message
    assert "GRPC_VERBOSITY" not in message


def test_port_in_use_with_listen_names_listen(tmp_path: Path, taken_addr: str) -> None:
    env = _env(tmp_path, KILN_LOG_FORMAT="console")
    result = _kiln(env, "serve", "engine-pool", "--listen", taken_addr)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: engine-pool: cannot listen on"), result.stderr
    assert "--listen" in last and "KILN_ENGINE_POOL_ADDR" not in last


async def test_kiln_serve_gives_the_engine_pool_the_baselines_measure(tmp_path: Path) -> None:
    settings = KilnSettings(metrics_port=0, state_dir=tmp_path)
    app = service_app("engine-pool")(settings)
    assert isinstance(app, EnginePoolApp) and app.pool.external_measure is measure_baseline
    assert service_app("ledger").__name__ == app_factory("ledger").__name__
    bare = app_factory("engine-pool")(settings)  # the service's own assembly: no baselines
    assert isinstance(bare, EnginePoolApp) and bare.pool.external_measure is None
    request = work(Candidate()).model_copy(update={"baseline": "gpt_fast"})
    with pytest.raises(FailedPrecondition, match="'gpt_fast': this engine pool measures no base"):
        await bare.pool.measure(Job.of(request))  # refused before any engine is built
    assert bare.pool.processes() == []
