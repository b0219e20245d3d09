"""User errors in the ``kiln`` CLI: one readable line on stderr, non-zero exit, no traceback."""

from __future__ import annotations

import json
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
    # KILN_PKI_DIR stays: the session's certificates (tests/pki.py)
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k == "KILN_PKI_DIR"
    }
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


@pytest.mark.parametrize(
    "args",
    [("compilations", "list"), ("compilations", "show", "c1"), ("compilations", "curve", "c1")],
)
def test_unreachable_agent_runner_is_one_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    addr = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = _kiln(*args, state_dir=tmp_path, KILN_AGENT_RUNNER_ADDR=addr)
    _assert_one_line_error(result, f"agent runner at {addr} is not reachable", "kiln up")


def test_no_credentials_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    result = _kiln(
        "ledger",
        "tail",
        "--no-follow",
        "--ledger-addr",
        addr,
        state_dir=tmp_path,
        KILN_PKI_DIR=str(tmp_path / "no-pki"),
    )
    line = _assert_one_line_error(result, "UNAUTHENTICATED", "spiffe://kiln/team/default")
    assert "kiln up" in line and "kiln credentials issue --team default" in line


def test_unreachable_nats_is_one_line(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    result = _kiln("ledger", "subscribe", state_dir=tmp_path, KILN_NATS_URL=url)
    _assert_one_line_error(result, f"NATS at {url} is not reachable", "kiln up")


def test_subscribe_without_nats_is_one_line(tmp_path: Path) -> None:
    _assert_one_line_error(_kiln("ledger", "subscribe", state_dir=tmp_path), "KILN_NATS_URL")


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("--stream", "compilation"), ("invalid stream id 'compilation'",)),
        (("--category", "Experiment"), ("invalid category 'Experiment'",)),
        (("--category", "widget"), ("unknown category 'widget'", "experiment")),
        (("--type", "ExperimentComplete"), ("unknown event type", "ExperimentCompleted")),
        (("--stream", "experiment-1", "--category", "compilation"), ("not in category",)),
        (("--category", "compilation", "--type", "ExperimentCompleted"), ("'experiment-*'",)),
        (("--all", "--since", "3"), ("--all or --since",)),
    ],
)
def test_bad_subscribe_options_are_one_line(
    tmp_path: Path, args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # checked before connecting
    result = _kiln("ledger", "subscribe", *args, state_dir=tmp_path, KILN_NATS_URL=url)
    line = _assert_one_line_error(result, *needles)
    assert "not reachable" not in line


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


def _assert_usage_error(result: subprocess.CompletedProcess[str], option: str) -> None:
    """A bad flag value: typer's usage box naming the option, exit 2, no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert f"'{option}'" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("ledger", "tail", "--no-follow", "--after", "-5"), "--after"),
        (("ledger", "tail", "--no-follow", "--max-count", "-1"), "--max-count"),
        (("ledger", "query", "compilations", "--limit", "-1"), "--limit"),
        (("ledger", "events", "compilation-x", "--from-version", "-1"), "--from-version"),
        (("health", "127.0.0.1:1", "--timeout", "-1"), "--timeout"),
        (("ledger", "subscribe", "--since", "0"), "--since"),
        (("ledger", "subscribe", "--count", "0"), "--count"),
    ],
)
def test_out_of_range_numbers_name_the_flag(
    tmp_path: Path, args: tuple[str, ...], option: str
) -> None:
    _assert_usage_error(_kiln(*args, state_dir=tmp_path), option)


def test_repeated_filter_key_is_one_line(tmp_path: Path) -> None:
    result = _kiln(
        "ledger", "query", "compilations", "--filter", "status=a", "--filter", "status=b",
        state_dir=tmp_path,
    )  # fmt: skip
    _assert_one_line_error(result, "--filter status given twice")


@pytest.mark.parametrize(
    "args",
    [
        ("--team", "", "ledger", "tail", "--no-follow"),
        ("ledger", "tail", "--no-follow", "--team", ""),
        ("ledger", "query", "compilations", "--team", ""),
    ],
)
def test_empty_team_flag_is_rejected_like_empty_env(tmp_path: Path, args: tuple[str, ...]) -> None:
    addr = f"127.0.0.1:{free_port()}"
    from_env = _kiln(
        "ledger", "tail", "--no-follow", "--ledger-addr", addr, state_dir=tmp_path, KILN_TEAM=""
    )
    expected = _assert_one_line_error(from_env, "UNAUTHENTICATED")
    assert _assert_one_line_error(_kiln(*args, state_dir=tmp_path, KILN_LEDGER_ADDR=addr)) == (
        expected
    )


@pytest.mark.parametrize(
    ("args", "env", "needles"),
    [
        (
            ("serve", "ledger", "--listen", "127.0.0.1:99999"),
            {},
            ("listen_addr", "--listen", "99999", "out of range"),
        ),
        (
            ("serve", "ledger", "--metrics-port", "70000"),
            {},
            ("metrics_port", "--metrics-port", "70000", "out of range"),
        ),
        (("status",), {"KILN_EMBEDDED_NATS_PORT": "0"}, ("KILN_EMBEDDED_NATS_PORT", "1..65535")),
        (("status",), {"KILN_AGENT_RUNNER_ADDR": "localhost"}, ("KILN_AGENT_RUNNER_ADDR",)),
    ],
)
def test_bad_ports_and_addresses_are_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], needles: tuple[str, ...]
) -> None:
    result = _kiln(*args, state_dir=tmp_path, KILN_LOG_FORMAT="console", **env)
    line = _assert_one_line_error(result, "invalid settings", *needles)
    assert "unexpected" not in line and "OverflowError" not in line


def test_serve_failure_is_one_json_line_in_a_json_log(tmp_path: Path) -> None:
    """``kiln serve`` writing to a log (not a terminal) with JSON logs reports its failure as
    one JSON line too, so the service log parses line by line."""
    result = _kiln("serve", "ledger", "--listen", "127.0.0.1:99999", state_dir=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    record = json.loads(lines[0])
    assert record["level"] == "error" and record["service"] == "ledger"
    assert "listen_addr" in record["error"] and "99999" in record["error"]


def test_second_up_while_the_state_dir_is_locked_is_one_line(tmp_path: Path) -> None:
    from kiln.embedded.lock import state_lock

    with state_lock(tmp_path):
        result = _kiln("up", state_dir=tmp_path)
        _assert_one_line_error(
            result, f"another kiln up/down is running for {tmp_path.resolve()} (pid {os.getpid()})"
        )
        _assert_one_line_error(_kiln("down", state_dir=tmp_path), "another kiln up/down")
    assert not (tmp_path / "postgres").exists()  # nothing was started


def test_a_bad_setting_is_named_by_its_own_variable() -> None:
    """Settings classes with their own prefix (KILN_QUOTA_, KILN_RUNNER_) are named by it."""
    from pydantic import ValidationError

    from kiln.agent_runner.config import RunnerSettings
    from kiln.agent_runner.quotas import QuotaSettings
    from kiln.cli.errors import describe

    for cls, field, env in (
        (RunnerSettings, "baseline_deadline_s", "KILN_RUNNER_BASELINE_DEADLINE_S"),
        (QuotaSettings, "max_running", "KILN_QUOTA_MAX_RUNNING"),
    ):
        try:
            cls(**{field: -1})
        except ValidationError as exc:
            assert f"{field} ({env})" in describe(exc)
        else:
            raise AssertionError(f"{cls.__name__} took {field}=-1")
