"""Identity and authorization over real gRPC and real certificates (docs/design/security.md).

In-process servers on the real PostgreSQL and NATS, each presenting its service certificate of
the session's CA (tests/pki.py): the ledger (and a second one with cross-team reads on), the agent
runner and the engine pool. Every refusal is checked for its status and that nothing was stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kiln.agent_runner.app import AgentRunnerApp
from kiln.agent_runner.config import RunnerConfig
from kiln.common.client import channel, team_channel
from kiln.common.errors import NotFound, PermissionDenied
from kiln.common.identity import Principal
from kiln.common.pki import CertificateAuthority
from kiln.common.server import ServiceStartError, serve
from kiln.common.settings import KilnSettings
from kiln.common.tls import TlsMaterial
from kiln.engine_pool.app import EnginePoolApp
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import (
    compiler_pb2,
    compiler_pb2_grpc,
    cost_model_pb2,
    cost_model_pb2_grpc,
    engine_pool_pb2,
    engine_pool_pb2_grpc,
    ledger_pb2,
    ledger_pb2_grpc,
)
from tests.databases import scratch_database

from ..pki import ServiceLedger, operator_tls, pki_dir, service_tls, team_tls
from ..unit.engine_testing import engine_settings
from ..unit.runtime_app import free_port
from .events_factory import best, completed, new_id, requested, submitted

pytestmark = pytest.mark.integration

ALPHA, BETA = "alpha", "beta"


@dataclass
class Deployment:
    ledger: str
    audit_ledger: str
    """A second ledger on the same database with KILN_CROSS_TEAM_READS on."""
    runner: str
    pool: str
    writer: ServiceLedger
    alpha_cid: str
    """A compilation of team alpha (its stream and one experiment), written as the services
    write them."""
    alpha_experiment: str


@pytest.fixture(scope="module")
def auth_database(postgres_server_url: str) -> Iterator[str]:
    """A database of its own, so the agent runner resumes nothing of other modules."""
    with scratch_database(postgres_server_url) as url:
        yield url


async def _serve(app: Any, cfg: KilnSettings, addr: str) -> asyncio.Task[None]:
    started = asyncio.Event()
    task = asyncio.create_task(serve(app, cfg, listen=addr, started=started, handle_signals=False))
    await asyncio.wait_for(started.wait(), 20)
    return task


@pytest_asyncio.fixture(scope="module")
async def deployment(
    settings: KilnSettings, auth_database: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Deployment]:
    ledger, audit, runner, pool = (f"127.0.0.1:{free_port()}" for _ in range(4))
    cfg = settings.model_copy(
        update={
            "database_url": auth_database,
            "subject_prefix": f"{settings.subject_prefix}au",
            "ledger_addr": ledger,
            "agent_runner_addr": runner,
            "engine_pool_addr": pool,
            "metrics_port": 0,
            "grace_period_s": 1.0,
            "state_dir": tmp_path_factory.mktemp("auth"),
        }
    )
    tasks = [await _serve(LedgerApp(cfg), cfg, ledger)]
    audit_cfg = cfg.model_copy(update={"cross_team_reads": True})
    tasks.append(await _serve(LedgerApp(audit_cfg), audit_cfg, audit))
    app = AgentRunnerApp(cfg, RunnerConfig(resume_retry_s=0.5))
    tasks.append(await _serve(app, cfg, runner))
    await asyncio.wait_for(app.resumed.wait(), 20)
    tasks.append(await _serve(EnginePoolApp(cfg, engine_settings(max_batch=4)), cfg, pool))
    # Team alpha's compilation, appended after the runner resumed (so it does not run it).
    cid, eid = new_id(), new_id()
    async with ServiceLedger(ledger, ALPHA) as writer:
        await writer.append(f"compilation-{cid}", [submitted()], "no_stream")
        await writer.append(f"experiment-{eid}", [requested(cid, eid, "cand-1")], "no_stream")
        yield Deployment(ledger, audit, runner, pool, writer, cid, eid)
    for task in reversed(tasks):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
def d(deployment: Deployment) -> Deployment:
    return deployment


async def _stream_types(d: Deployment, stream: str) -> list[str]:
    return [e.type for e in await d.writer.read_stream(stream)]


def _code(err: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return err.value.code()


# ------------------------------------------------------------------------------------------ #
# Authentication                                                                             #
# ------------------------------------------------------------------------------------------ #


async def _read_stream(ch: grpc.aio.Channel, stream: str) -> Any:
    stub = ledger_pb2_grpc.LedgerStub(ch)
    return await stub.ReadStream(ledger_pb2.ReadStreamRequest(stream_id=stream), timeout=5)


async def test_plaintext_and_certificate_less_clients_fail_the_handshake(d: Deployment) -> None:
    stream = f"compilation-{d.alpha_cid}"
    async with channel(d.ledger, tls=None) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_stream(plain, stream)
    assert _code(err) == grpc.StatusCode.UNAVAILABLE
    ca_only = grpc.ssl_channel_credentials(team_tls(ALPHA).ca)  # verifies the server, no cert
    async with grpc.aio.secure_channel(d.ledger, ca_only) as anonymous:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_stream(anonymous, stream)
    assert _code(err) == grpc.StatusCode.UNAVAILABLE  # refused in the TLS handshake


async def test_a_certificate_of_another_ca_fails_the_handshake(
    d: Deployment, tmp_path: Path
) -> None:
    other = CertificateAuthority.open_or_create(tmp_path / "other-ca")
    issued = other.issue(Principal("team", ALPHA))  # the right name, the wrong CA
    forged = TlsMaterial(
        team_tls(ALPHA).ca,  # it trusts the deployment's server
        (issued.path / "cert.pem").read_bytes(),
        (issued.path / "key.pem").read_bytes(),
        "forged",
    )
    async with team_channel(d.ledger, ALPHA, tls=forged) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_stream(ch, f"compilation-{d.alpha_cid}")
    assert _code(err) == grpc.StatusCode.UNAVAILABLE


def _certificate_without_kiln_uri() -> TlsMaterial:
    """A certificate of the deployment's CA whose SAN URI is not a kiln principal."""
    ca_key = serialization.load_pem_private_key((pki_dir() / "ca.key").read_bytes(), None)
    ca_cert = x509.load_pem_x509_certificate((pki_dir() / "ca.pem").read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier("spiffe://other/x/y")]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return TlsMaterial(ca_cert.public_bytes(pem), cert.public_bytes(pem), key_pem, "stranger")


async def test_a_certificate_naming_no_kiln_principal_is_unauthenticated(d: Deployment) -> None:
    async with team_channel(d.ledger, ALPHA, tls=_certificate_without_kiln_uri()) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_stream(ch, f"compilation-{d.alpha_cid}")
    assert _code(err) == grpc.StatusCode.UNAUTHENTICATED
    assert "kiln principals" in (err.value.details() or "")


async def test_a_team_sending_another_teams_header_is_denied(d: Deployment) -> None:
    async with team_channel(d.ledger, BETA, tls=team_tls(ALPHA)) as ch:  # alpha claims beta
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _read_stream(ch, f"compilation-{d.alpha_cid}")
    assert _code(err) == grpc.StatusCode.PERMISSION_DENIED
    assert "spiffe://kiln/team/alpha may act only for team 'alpha'" in (err.value.details() or "")
    async with team_channel(d.runner, BETA, tls=team_tls(ALPHA)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await compiler_pb2_grpc.CompilerStub(ch).List(compiler_pb2.ListRequest(), timeout=5)
    assert _code(err) == grpc.StatusCode.PERMISSION_DENIED


# ------------------------------------------------------------------------------------------ #
# Writes                                                                                     #
# ------------------------------------------------------------------------------------------ #


@pytest.mark.parametrize("owner", [ALPHA, BETA])
async def test_a_team_cannot_append_results_or_bests(d: Deployment, owner: str) -> None:
    """Team beta forges a measurement and a best into alpha's compilation (owner alpha) and
    into one of its own (owner beta): both refused, nothing stored."""
    cid, eid = d.alpha_cid, d.alpha_experiment
    if owner == BETA:
        cid, eid = new_id(), new_id()
        async with ServiceLedger(d.ledger, BETA) as beta_writer:
            await beta_writer.append(f"compilation-{cid}", [submitted()], "no_stream")
            await beta_writer.append(f"experiment-{eid}", [requested(cid, eid, "c")], "no_stream")
    before = await _stream_types(d, f"compilation-{cid}")
    async with LedgerClient(d.ledger, BETA, tls=team_tls(BETA)) as beta:
        with pytest.raises(PermissionDenied, match=r"may not call kiln\.v1\.Ledger/Append"):
            await beta.append(f"experiment-{eid}", [completed(cid, eid, "cand-1", 1e6)], 1)
        with pytest.raises(PermissionDenied, match=r"may not call kiln\.v1\.Ledger/Append"):
            await beta.append(f"compilation-{cid}", [best("wk", eid, "cand-1", 1e6, 99.0)])
    assert await _stream_types(d, f"experiment-{eid}") == ["ExperimentRequested"]
    assert await _stream_types(d, f"compilation-{cid}") == before


async def test_each_service_appends_only_its_own_events(d: Deployment) -> None:
    cid, eid = d.alpha_cid, new_id()
    runner = LedgerClient(d.ledger, ALPHA, tls=service_tls("agent-runner"))
    engine = LedgerClient(d.ledger, ALPHA, tls=service_tls("engine-pool"))
    cost = LedgerClient(d.ledger, ALPHA, tls=service_tls("cost-model"))
    try:
        await runner.append(f"experiment-{eid}", [requested(cid, eid, "c")], "no_stream")
        with pytest.raises(PermissionDenied, match=r"ExperimentCompleted \(status 'ok'\)"):
            await runner.append(f"experiment-{eid}", [completed(cid, eid, "c", 1e6)], 1)
        with pytest.raises(PermissionDenied, match="BestCandidateImproved"):
            await engine.append(f"compilation-{cid}", [best("wk", eid, "c", 1e6, 9.0)])
        with pytest.raises(PermissionDenied, match="cost-model"):
            await cost.append(f"compilation-{cid}", [best("wk", eid, "c", 1e6, 9.0)])
        crashed = completed(cid, eid, "c", 1.0, ok=False)
        timed_out = NewEvent(crashed.type, {**crashed.data, "status": "timed_out"})
        assert not (await runner.append(f"experiment-{eid}", [timed_out], 1)).already_stored
        with pytest.raises(PermissionDenied, match="ExperimentRequested"):
            await engine.append(f"experiment-{new_id()}", [requested(cid, eid, "c")])
        other = new_id()
        await runner.append(f"experiment-{other}", [requested(cid, other, "c")], "no_stream")
        await engine.append(f"experiment-{other}", [completed(cid, other, "c", 10.0)], 1)
        (event, done) = await runner.read_stream(f"experiment-{other}")
        assert done.metadata.principal == "spiffe://kiln/service/engine-pool"
        assert done.metadata.team == ALPHA and event.metadata.team == ALPHA
    finally:
        for client in (runner, engine, cost):
            await client.close()


# ------------------------------------------------------------------------------------------ #
# Reads                                                                                      #
# ------------------------------------------------------------------------------------------ #


async def test_a_team_reads_only_its_own_records(d: Deployment) -> None:
    stream = f"compilation-{d.alpha_cid}"
    async with LedgerClient(d.ledger, BETA, tls=team_tls(BETA)) as beta:
        with pytest.raises(NotFound) as foreign:
            await beta.read_stream(stream)
        with pytest.raises(NotFound) as unknown:
            await beta.read_stream(f"compilation-{new_id()}")
        # the same answer as an unknown id: nothing tells beta the stream exists
        assert foreign.value.message == f"stream {stream!r} has no events"
        assert unknown.value.message.endswith("has no events")
        assert [e async for e in beta.read_all() if e.metadata.team != BETA] == []
        assert await beta.query("compilations", {"compilation_id": d.alpha_cid}) == []
        assert await beta.query("experiments", {"compilation_id": d.alpha_cid}) == []
        with pytest.raises(PermissionDenied, match="cross-team reads are off"):
            await beta.query("compilations", {"team": ALPHA})
    async with LedgerClient(d.ledger, ALPHA, tls=team_tls(ALPHA)) as alpha:
        assert [e.type for e in await alpha.read_stream(stream)] == ["CompilationSubmitted"]
        mine = [e.stream_id async for e in alpha.read_all()]
        assert stream in mine and f"experiment-{d.alpha_experiment}" in mine
    # Cross-team reads on (audit), and operators, see alpha's records.
    async with LedgerClient(d.audit_ledger, BETA, tls=team_tls(BETA)) as audit:
        assert [e.type for e in await audit.read_stream(stream)] == ["CompilationSubmitted"]
    async with LedgerClient(d.ledger, ALPHA, tls=operator_tls()) as operator:
        assert len(await operator.read_stream(stream)) == 1


async def test_replay_is_for_operators(d: Deployment) -> None:
    async with LedgerClient(d.ledger, ALPHA, tls=team_tls(ALPHA)) as alpha:
        with pytest.raises(PermissionDenied, match=r"Ledger/Replay: the policy allows only"):
            await alpha.replay()
    async with LedgerClient(d.ledger, ALPHA, tls=operator_tls()) as operator:
        assert (await operator.replay()).equal


async def test_compiler_reads_and_cancels_are_scoped_to_the_team(d: Deployment) -> None:
    cid = d.alpha_cid
    async with team_channel(d.runner, BETA) as ch:  # beta's own certificate
        beta = compiler_pb2_grpc.CompilerStub(ch)
        for call in (
            beta.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=10),
            beta.Cancel(compiler_pb2.CancelRequest(compilation_id=cid), timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert _code(err) == grpc.StatusCode.NOT_FOUND
            assert err.value.details() == f"no compilation {cid!r}"
        watch = beta.Watch(compiler_pb2.WatchRequest(compilation_id=cid), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await watch.read()
        assert _code(err) == grpc.StatusCode.NOT_FOUND
        for team in ("*", ALPHA):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await beta.List(compiler_pb2.ListRequest(team=team), timeout=10)
            assert _code(err) == grpc.StatusCode.PERMISSION_DENIED
        own = await beta.List(compiler_pb2.ListRequest(), timeout=10)
        assert cid not in {c.compilation_id for c in own.compilations}
    assert await _stream_types(d, f"compilation-{cid}") == ["CompilationSubmitted"]
    async with team_channel(d.runner, ALPHA) as ch:
        alpha = compiler_pb2_grpc.CompilerStub(ch)
        seen = await alpha.Get(compiler_pb2.GetRequest(compilation_id=cid), timeout=10)
        assert seen.team == ALPHA
        listed = await alpha.List(compiler_pb2.ListRequest(), timeout=10)
        assert cid in {c.compilation_id for c in listed.compilations}
    async with team_channel(d.runner, ALPHA, tls=operator_tls()) as ch:
        everyone = await compiler_pb2_grpc.CompilerStub(ch).List(
            compiler_pb2.ListRequest(team="*"), timeout=10
        )
        assert cid in {c.compilation_id for c in everyone.compilations}


async def test_submit_is_for_teams(d: Deployment) -> None:
    async with team_channel(d.runner, ALPHA, tls=operator_tls()) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await compiler_pb2_grpc.CompilerStub(ch).Submit(compiler_pb2.SubmitRequest())
    assert _code(err) == grpc.StatusCode.PERMISSION_DENIED
    assert "spiffe://kiln/operator/admin may not call kiln.v1.Compiler/Submit" in (
        err.value.details() or ""
    )


# ------------------------------------------------------------------------------------------ #
# The engine pool                                                                            #
# ------------------------------------------------------------------------------------------ #


async def test_a_team_may_not_run_experiments_but_may_list_engines(d: Deployment) -> None:
    async with team_channel(d.pool, ALPHA) as ch:
        stub = engine_pool_pb2_grpc.EnginePoolStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.RunExperiment(engine_pool_pb2.RunExperimentRequest(), timeout=10)
        assert _code(err) == grpc.StatusCode.PERMISSION_DENIED
        assert "RunExperiment: the policy allows only service, operator" in (
            err.value.details() or ""
        )
        await stub.ListEngines(engine_pool_pb2.ListEnginesRequest(local_only=True), timeout=10)
    async with team_channel(d.pool, ALPHA, tls=operator_tls()) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:  # past the policy: the request's turn
            await engine_pool_pb2_grpc.EnginePoolStub(ch).RunExperiment(
                engine_pool_pb2.RunExperimentRequest(), timeout=10
            )
        assert _code(err) == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------------------------------ #
# Configuration                                                                              #
# ------------------------------------------------------------------------------------------ #


async def test_a_policy_file_overrides_a_default(settings: KilnSettings, tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[rpc]\n"kiln.v1.CostModel/Plan" = ["operator"]\n')
    cfg = settings.model_copy(update={"policy_file": policy, "metrics_port": 0})
    from kiln.cost_model.app import create_app

    addr = f"127.0.0.1:{free_port()}"
    task = await _serve(create_app(cfg), cfg, addr)
    try:
        async with team_channel(addr, ALPHA) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest())
        assert _code(err) == grpc.StatusCode.PERMISSION_DENIED
        async with team_channel(addr, ALPHA, tls=operator_tls()) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest())
        assert _code(err) == grpc.StatusCode.INVALID_ARGUMENT  # allowed: the empty request fails
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_an_invalid_policy_file_or_missing_certificate_stops_the_start(
    settings: KilnSettings, tmp_path: Path
) -> None:
    from kiln.cost_model.app import create_app

    bad = tmp_path / "policy.toml"
    bad.write_text(
        '[[append]]\nservice = "engine-pool"\ncategory = "experiment"\ntypes = ["Nope"]\n'
    )
    cfg = settings.model_copy(update={"policy_file": bad, "metrics_port": 0})
    with pytest.raises(ServiceStartError, match=r"policy file .*unknown event types \['Nope'\]"):
        await serve(create_app(cfg), cfg, listen=f"127.0.0.1:{free_port()}", handle_signals=False)
    empty = settings.model_copy(update={"pki_dir": tmp_path / "no-pki", "metrics_port": 0})
    with pytest.raises(ServiceStartError) as err:
        await serve(create_app(empty), empty, listen=f"127.0.0.1:{free_port()}")
    message = str(err.value)
    assert "\n" not in message and "spiffe://kiln/service/cost-model" in message
    assert "kiln credentials issue --service cost-model" in message and "KILN_TLS=off" in message


async def test_tls_off_trusts_the_header_as_before(settings: KilnSettings) -> None:
    from kiln.cost_model.app import create_app

    cfg = settings.model_copy(update={"tls": "off", "metrics_port": 0})
    addr = f"127.0.0.1:{free_port()}"
    task = await _serve(create_app(cfg), cfg, addr)
    try:
        async with team_channel(addr, "anyone", tls=None) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await cost_model_pb2_grpc.CostModelStub(ch).Plan(cost_model_pb2.PlanRequest())
        assert _code(err) == grpc.StatusCode.INVALID_ARGUMENT  # served, in plaintext
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
