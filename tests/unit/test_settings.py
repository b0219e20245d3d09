"""Settings validation (ports and addresses) and where a service's metrics endpoint binds."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.common import metrics
from kiln.common.metrics import metrics_host
from kiln.common.server import serve
from kiln.common.settings import KilnSettings, split_host_port

from .runtime_app import RuntimeTestApp, free_port


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("listen_addr", "127.0.0.1:99999", "port 99999 is out of range 0..65535"),
        ("listen_addr", "127.0.0.1", "expected HOST:PORT"),
        ("listen_addr", ":50051", "expected HOST:PORT"),
        ("ledger_addr", "127.0.0.1:0", "port 0 is out of range 1..65535"),
        ("ledger_addr", "ledger:http", "expected HOST:PORT"),
        ("agent_runner_addr", "127.0.0.1:65536", "out of range"),
        ("metrics_port", 70000, "port 70000 is out of range 0..65535"),
        ("metrics_port", -1, "out of range"),
        ("embedded_nats_port", 0, "port 0 is out of range 1..65535"),
        ("embedded_postgres_port", 65536, "out of range"),
    ],
)
def test_bad_ports_and_addresses_are_rejected(
    tmp_path: Path, field: str, value: object, reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        KilnSettings(state_dir=tmp_path, **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("listen_addr", "127.0.0.1:0"),  # an ephemeral port to bind
        ("listen_addr", "0.0.0.0:50051"),
        ("listen_addr", "[::]:50051"),
        ("listen_addr", "unix:/tmp/kiln.sock"),
        ("ledger_addr", "ledger:50051"),
        ("ledger_addr", "dns:///ledger:50051"),
        ("ledger_addr", "[::1]:65535"),
        ("metrics_port", 0),  # off
        ("metrics_port", 65535),
        ("embedded_nats_port", 1),
    ],
)
def test_good_ports_and_addresses_pass(tmp_path: Path, field: str, value: object) -> None:
    settings = KilnSettings(state_dir=tmp_path, **{field: value})  # type: ignore[arg-type]
    assert getattr(settings, field) == value


def test_ports_from_the_environment_are_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_METRICS_PORT", "70000")
    with pytest.raises(ValidationError, match="metrics_port"):
        KilnSettings(state_dir=tmp_path)


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert split_host_port("[::1]:50051") == ("::1", 50051)
    assert split_host_port("dns:///ledger:50051") == ("ledger", 50051)
    assert split_host_port("0.0.0.0:0", allow_zero=True) == ("0.0.0.0", 0)
    with pytest.raises(ValueError, match="out of range"):
        split_host_port("0.0.0.0:0")


def test_default_metrics_ports(tmp_path: Path) -> None:
    settings = KilnSettings(state_dir=tmp_path)
    ports = [settings.service_metrics_port(name) for name in ("ledger", "engine-pool")]
    ports += [settings.service_metrics_port(name) for name in ("agent-runner", "cost-model")]
    assert ports == [9401, 9402, 9403, 9404]


@pytest.mark.parametrize(
    ("listen", "host"),
    [
        ("127.0.0.1:50051", "127.0.0.1"),
        ("0.0.0.0:50051", "0.0.0.0"),
        ("[::]:50051", "::"),
        ("localhost:0", "localhost"),
        ("unix:/tmp/kiln.sock", "127.0.0.1"),
    ],
)
def test_metrics_host_follows_the_listen_address(listen: str, host: str) -> None:
    assert metrics_host(listen) == host


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
async def test_metrics_endpoint_binds_the_listen_host(tmp_path: Path, host: str) -> None:
    port = free_port()
    settings = KilnSettings(metrics_port=port, grace_period_s=0.5, state_dir=tmp_path)
    started = asyncio.Event()
    task = asyncio.create_task(
        serve(
            RuntimeTestApp(),
            settings,
            listen=f"{host}:{free_port()}",
            started=started,
            handle_signals=False,
        )
    )
    try:
        await asyncio.wait_for(started.wait(), 5)
        assert metrics._servers[port].server_address[0] == host
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
