"""The NATS users' table, the configurations rendered from it (checked by the real nats-server),
the credentials the settings resolve, and the embedded server run with users."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from kiln.common import nats as kn
from kiln.common.settings import KilnSettings
from kiln.embedded.nats import EmbeddedNats, nats_problem, nats_server_binary
from kiln.embedded.nats_auth import (
    NATS_USERS,
    NatsPasswords,
    compose_config,
    password_variable,
    permissions,
    render_config,
)
from kiln.embedded.postgres import free_port

REPO = Path(__file__).resolve().parents[2]
COMPOSE_CONFIG = REPO / "deploy" / "nats" / "nats-server.conf"


# --- the table -------------------------------------------------------------------------------
def test_the_compose_configuration_is_the_generated_one() -> None:
    assert COMPOSE_CONFIG.read_text() == compose_config(), (
        "regenerate: python -c 'from kiln.embedded.nats_auth import compose_config; "
        'print(compose_config(), end="")\' > deploy/nats/nats-server.conf'
    )


def test_stream_management_is_the_owners_and_nobody_deletes() -> None:
    table = permissions("kiln")
    managed = {kn.stream_name("kiln", kind): owner for kind, owner in kn.STREAM_OWNERS.items()} | {
        f"KV_{kn.registry_bucket('kiln')}": "engine-pool"
    }
    operator = table.pop("operator")  # the deployment's owner: everything but deleting
    assert operator.publish[-1] == ">" and set(operator.deny_publish) == {
        "$JS.API.STREAM.DELETE.>",
        "$JS.API.STREAM.PURGE.>",
        "$JS.API.STREAM.MSG.DELETE.>",
    }
    for user, perms in table.items():
        assert perms.deny_publish == ()
        for subject in perms.publish:
            assert not subject.startswith(("$JS.API.>", "$JS.>", ">", "$JS.API.*")), subject
            assert ".DELETE." not in subject or subject.startswith("$JS.API.CONSUMER.DELETE.")
            assert ".PURGE." not in subject and ".MSG.DELETE." not in subject, subject
            for verb in ("CREATE", "UPDATE"):
                if subject.startswith(f"$JS.API.STREAM.{verb}."):
                    stream = subject.removeprefix(f"$JS.API.STREAM.{verb}.")
                    assert managed[stream] == user, (user, subject)
        inbox = f"{kn.inbox_prefix(user)}.>"
        extra = [s for s in perms.subscribe if s != inbox]
        assert inbox in perms.subscribe
        pool = ["kiln.work.experiments.>", "kiln.microbench.>"]  # work; microbenchmark asks
        assert extra == (pool if user == "engine-pool" else []), user


def test_only_the_producers_publish_the_streams_subjects() -> None:
    table = permissions("kiln")
    producers = {
        "kiln.events.>": {"ledger"},
        "kiln.board.>": {"agent-runner"},
        "kiln.work.experiments.>": {"agent-runner"},
        "$JS.API.CONSUMER.MSG.NEXT.KILN_WORK.*": {"engine-pool"},
        "$JS.ACK.KILN_WORK.>": {"engine-pool"},
        "kiln.microbench.>": {"cost-model"},
    }
    for subject, allowed in producers.items():
        assert {u for u, p in table.items() if subject in p.publish} == allowed, subject
    assert table["cost-model"].publish == ("$JS.API.INFO", "kiln.microbench.>")


def _check(config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [nats_server_binary(), "-t", "-c", str(config)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_nats_server_accepts_the_rendered_configurations(tmp_path: Path) -> None:
    embedded = tmp_path / "embedded.conf"
    embedded.write_text(
        render_config(
            "kiln",
            {u: f"pw-{u}" for u in NATS_USERS},
            host="127.0.0.1",
            port=14222,
            store_dir=tmp_path / "js",
            pid_file=tmp_path / "pid",
            log_file=tmp_path / "log",
        )
    )
    assert _check(embedded).returncode == 0, _check(embedded).stderr
    env = {password_variable(u): f"secret-{u}" for u in NATS_USERS}
    assert _check(COMPOSE_CONFIG, env).returncode == 0
    missing = {k: v for k, v in env.items() if k != password_variable("ledger")}
    refused = _check(COMPOSE_CONFIG, missing)
    assert refused.returncode != 0 and password_variable("ledger") in refused.stderr


# --- credentials from settings ---------------------------------------------------------------
def test_credentials_from_the_environment(tmp_path: Path) -> None:
    assert KilnSettings(state_dir=tmp_path, nats_url="nats://x:4222").nats_credentials() is None
    # a password no path or default contains (a tmp dir was once named ..._pw14)
    given = KilnSettings(state_dir=tmp_path, nats_user="ledger", nats_password="Zq9-secret-Xv")
    assert given.nats_credentials() == ("ledger", "Zq9-secret-Xv")
    assert "Zq9-secret-Xv" not in repr(given)
    secret = tmp_path / "secret"
    secret.write_text("from-file\n")
    by_file = KilnSettings(state_dir=tmp_path, nats_user="ledger", nats_password_file=secret)
    assert by_file.nats_credentials() == ("ledger", "from-file")
    with pytest.raises(RuntimeError, match="KILN_NATS_PASSWORD"):
        KilnSettings(state_dir=tmp_path, nats_user="ledger").nats_credentials()
    with pytest.raises(RuntimeError, match="KILN_NATS_USER"):
        KilnSettings(state_dir=tmp_path, nats_password="pw").nats_credentials()
    missing = KilnSettings(state_dir=tmp_path, nats_user="x", nats_password_file=tmp_path / "no")
    with pytest.raises(RuntimeError, match="cannot read KILN_NATS_PASSWORD_FILE"):
        missing.nats_credentials()


def test_the_cli_finds_its_user_of_the_embedded_nats(tmp_path: Path) -> None:
    passwords = NatsPasswords.of_state_dir(tmp_path)
    cli_password = passwords.ensure()["cli"]
    endpoints = tmp_path / "endpoints.json"
    url = "nats://127.0.0.1:14999"
    record = {"nats_url": url, "database_url": "postgresql://x", "embedded": {"nats": True}}
    endpoints.write_text(json.dumps(record))
    assert KilnSettings(state_dir=tmp_path).nats_credentials() == ("cli", cli_password)
    assert KilnSettings(state_dir=tmp_path, nats_url=url).nats_credentials() == (
        "cli",
        cli_password,
    )
    other = KilnSettings(state_dir=tmp_path, nats_url="nats://elsewhere:4222")
    assert other.nats_credentials() is None  # not the embedded server: no password of ours
    endpoints.write_text(json.dumps(record | {"embedded": {"nats": False}}))
    assert KilnSettings(state_dir=tmp_path).nats_credentials() is None


# --- the embedded server with users ----------------------------------------------------------
@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    passwords = NatsPasswords(tmp_path / "credentials")
    nats_server = EmbeddedNats(tmp_path / "nats", free_port(), passwords=passwords, prefix="ka")
    try:
        yield nats_server
    finally:
        nats_server.stop()


@pytest.mark.embedded
def test_the_embedded_nats_admits_only_its_users_and_keeps_their_passwords(
    server: EmbeddedNats,
) -> None:
    url = server.start()
    assert server.config_file.stat().st_mode & 0o777 == 0o600
    assert server.passwords is not None
    first = server.passwords.ensure()
    assert asyncio.run(nats_problem(url, credentials=server.probe_credentials)) is None
    refused = asyncio.run(nats_problem(url))
    assert refused is not None and "Authorization Violation" in refused
    server.stop()
    again = EmbeddedNats(server.data_dir, free_port(), passwords=server.passwords, prefix="ka")
    assert again.start() == f"nats://127.0.0.1:{again.port}"
    assert server.passwords.ensure() == first
    assert asyncio.run(nats_problem(again.url, credentials=("ledger", first["ledger"]))) is None


@pytest.mark.embedded
def test_a_running_embedded_nats_reloads_a_changed_configuration(server: EmbeddedNats) -> None:
    url = server.start()
    pid = server.pid
    assert server.passwords is not None
    renamed = EmbeddedNats(server.data_dir, 1, passwords=server.passwords, prefix="kb")
    assert renamed.start() == url and renamed.pid == pid  # the running one, its port adopted
    assert '"kb.events.>"' in server.config_file.read_text()

    user, password = server.passwords.credentials("ledger") or ("", "")

    async def can_publish(prefix: str) -> bool:
        errors: list[str] = []

        async def record(exc: Exception) -> None:  # a refused publish is reported here
            errors.append(str(exc))

        nc = await nats.connect(url, user=user, password=password, error_cb=record)
        try:
            await nc.publish(f"{prefix}.events.x", b"")
            await nc.flush()
            await asyncio.sleep(0.2)
        finally:
            await nc.close()
        return not errors

    for _ in range(50):  # the reload is asynchronous
        if asyncio.run(can_publish("kb")):
            break
    assert asyncio.run(can_publish("kb")) and not asyncio.run(can_publish("ka"))


@pytest.mark.embedded
def test_an_embedded_nats_without_users_is_not_silently_kept(tmp_path: Path) -> None:
    open_server = EmbeddedNats(tmp_path / "nats", free_port())
    open_server.start()
    try:
        passwords = NatsPasswords(tmp_path / "credentials")
        wanted = EmbeddedNats(tmp_path / "nats", 1, passwords=passwords)
        with pytest.raises(RuntimeError, match=r"runs without users.*kiln down"):
            wanted.start()
    finally:
        open_server.stop()


@pytest.mark.embedded
def test_the_cost_model_asks_the_engine_pool_for_microbenchmarks(server: EmbeddedNats) -> None:
    """The request/reply of the cost model's tier 2 passes the embedded server's permissions:
    the cost model requests on ``ka.microbench.<kind>``, the engine pool answers in its inbox;
    the CLI may do neither."""
    from kiln.common.nats import connect

    url = server.start()
    assert server.passwords is not None
    creds = {u: server.passwords.credentials(u) for u in ("cost-model", "engine-pool", "cli")}

    async def ask(asker: str) -> bytes | None:
        pool = await connect(url, "test-pool", credentials=creds["engine-pool"])
        cost = await connect(url, "test-cost", credentials=creds[asker])
        try:

            async def answer(msg: Any) -> None:
                await msg.respond(b"measured:" + msg.data)

            await pool.subscribe("ka.microbench.cpu", cb=answer)
            await pool.flush()
            try:
                reply = await cost.request("ka.microbench.cpu", b"gemm", timeout=2.0)
            except Exception:
                return None
            return bytes(reply.data)
        finally:
            await cost.close()
            await pool.close()

    assert asyncio.run(ask("cost-model")) == b"measured:gemm"
    assert asyncio.run(ask("cli")) is None
