"""User errors in the ``kiln`` CLI: one readable line on stderr, non-zero exit, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kiln.cli.errors import CliError, describe
from kiln.common.errors import NotFound, from_rpc_error
from kiln.embedded.postgres import free_port


def _kiln(*args: str, state_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    clean.update(KILN_STATE_DIR=str(state_dir), COLUMNS="200", **env)
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        ("ledger", "events", "compilation-x"),
        ("ledger", "tail", "--no-follow"),
        ("ledger", "query", "compilations"),
        ("ledger", "replay"),
    ],
)
def test_unreachable_ledger_is_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = _kiln(*args, "--ledger-addr", addr, state_dir=tmp_path)
    _assert_one_line_error(result, f"ledger at {addr} is not reachable", "kiln up")


def test_global_ledger_addr_option_and_env(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    result = _kiln("--ledger-addr", addr, "ledger", "events", "compilation-x", state_dir=tmp_path)
    _assert_one_line_error(result, addr)
    result = _kiln("ledger", "events", "compilation-x", state_dir=tmp_path, KILN_LEDGER_ADDR=addr)
    _assert_one_line_error(result, addr)


def test_migrate_without_a_database_is_one_line(tmp_path: Path) -> None:
    _assert_one_line_error(_kiln("migrate", state_dir=tmp_path), "KILN_DATABASE_URL", "kiln up")


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/kiln"
    _assert_one_line_error(_kiln("migrate", "--database-url", url, state_dir=tmp_path), "database")


def test_invalid_setting_is_one_line(tmp_path: Path) -> None:
    result = _kiln("status", state_dir=tmp_path, KILN_SUBJECT_PREFIX="Not Valid")
    _assert_one_line_error(result, "invalid settings", "subject_prefix")


def test_bad_filter_is_one_line(tmp_path: Path) -> None:
    result = _kiln("ledger", "query", "compilations", "--filter", "nonsense", state_dir=tmp_path)
    _assert_one_line_error(result, "KEY=VALUE")


def test_status_of_nothing_exits_3(tmp_path: Path) -> None:
    ports = {
        "KILN_LEDGER_ADDR": f"127.0.0.1:{free_port()}",
        "KILN_EMBEDDED_POSTGRES_PORT": str(free_port()),
    }
    result = _kiln("status", state_dir=tmp_path, **ports)
    assert result.returncode == 3
    assert "not running" in result.stdout
    assert "Traceback" not in result.stderr


def test_describe_names_the_grpc_code() -> None:
    assert describe(NotFound("no stream 'compilation-x'")) == "NOT_FOUND: no stream 'compilation-x'"
    assert describe(CliError("plain words")) == "plain words"

    class FakeRpcError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.ABORTED

        def details(self) -> str:
            return "stale version"

    assert describe(FakeRpcError()) == "ABORTED: stale version"
    assert from_rpc_error(FakeRpcError()).message == "stale version"
