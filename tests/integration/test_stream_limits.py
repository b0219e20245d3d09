"""Open follows per caller (kiln.common.stream_limits) on a real ledger over mTLS: a team beyond
its limit is RESOURCE_EXHAUSTED, other teams and services are not affected, and a closed follow
frees its place."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from kiln.common.client import team_channel
from kiln.common.identity import CallIdentity, Principal
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.common.stream_limits import StreamLimiter, caller_key
from kiln.ledger.app import LedgerApp
from kiln.v1 import ledger_pb2, ledger_pb2_grpc
from tests.databases import scratch_database

from ..pki import ServiceLedger, service_tls, team_tls
from ..unit.runtime_app import free_port
from .events_factory import new_id, submitted

pytestmark = pytest.mark.integration

LIMIT = 2
ALPHA, BETA = "alpha", "beta"


async def _serve(app: LedgerApp, cfg: KilnSettings, addr: str) -> asyncio.Task[None]:
    started = asyncio.Event()
    task = asyncio.create_task(serve(app, cfg, listen=addr, started=started, handle_signals=False))
    await asyncio.wait_for(started.wait(), 20)
    return task


def test_the_limiter_counts_per_caller_and_skips_services() -> None:
    limiter = StreamLimiter(1, "follows")
    alpha = CallIdentity(ALPHA, principal=Principal("team", ALPHA))
    runner = CallIdentity(ALPHA, principal=Principal("service", "agent-runner"))
    with limiter.hold(alpha):
        with pytest.raises(Exception, match="already holds 1 open follows"):
            with limiter.hold(alpha):
                pass
        with limiter.hold(runner), limiter.hold(runner):  # a service is not counted
            assert caller_key(runner) is None
        with limiter.hold(CallIdentity(BETA, principal=Principal("team", BETA))):
            pass
    assert limiter.open_count(caller_key(alpha) or "") == 0
    with limiter.hold(alpha):  # the place was freed
        pass
    with pytest.raises(ValueError):
        StreamLimiter(0, "follows")


@pytest_asyncio.fixture(scope="module")
async def ledger_addr(
    settings: KilnSettings, postgres_server_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, str]]:
    """A ledger allowing LIMIT follows per caller, and a stream of team alpha's."""
    with scratch_database(postgres_server_url) as url:
        addr = f"127.0.0.1:{free_port()}"
        cfg = settings.model_copy(
            update={
                "database_url": url,
                "subject_prefix": f"{settings.subject_prefix}sl",
                "ledger_addr": addr,
                "metrics_port": 0,
                "grace_period_s": 1.0,
                "max_follows_per_caller": LIMIT,
                "state_dir": tmp_path_factory.mktemp("limits"),
            }
        )
        task = await _serve(LedgerApp(cfg), cfg, addr)
        stream = f"compilation-{new_id()}"
        async with ServiceLedger(addr, ALPHA) as writer:
            await writer.append(stream, [submitted()], "no_stream")
        yield addr, stream
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _follow(stub: ledger_pb2_grpc.LedgerStub, stream: str) -> Any:
    return stub.ReadAll(ledger_pb2.ReadAllRequest(follow=True, stream_prefix=stream))


async def test_a_team_beyond_its_follows_is_refused_and_others_are_not(
    ledger_addr: tuple[str, str],
) -> None:
    addr, stream = ledger_addr
    async with (
        team_channel(addr, ALPHA, tls=team_tls(ALPHA)) as alpha_ch,
        team_channel(addr, BETA, tls=team_tls(BETA)) as beta_ch,
        team_channel(addr, ALPHA, tls=service_tls("agent-runner")) as runner_ch,
    ):
        alpha, beta = ledger_pb2_grpc.LedgerStub(alpha_ch), ledger_pb2_grpc.LedgerStub(beta_ch)
        runner = ledger_pb2_grpc.LedgerStub(runner_ch)
        held: list[Any] = [_follow(alpha, stream) for _ in range(LIMIT)]
        for call in held:  # its first event proves the server holds the follow
            assert (await call.read()).stream_id == stream
        extra = _follow(alpha, stream)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await extra.read()
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already holds 2 open ledger follows" in (refused.value.details() or "")
        # one page without follow is still served
        page = [e async for e in alpha.ReadAll(ledger_pb2.ReadAllRequest(stream_prefix=stream))]
        assert [e.stream_id for e in page] == [stream]
        # beta is not affected (it sees nothing of alpha's, but its follow is open) ...
        beta_call = beta.ReadAll(ledger_pb2.ReadAllRequest(follow=True))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(beta_call.read(), 0.5)
        # ... nor a service, which multiplexes its own clients' follows
        services: list[Any] = [_follow(runner, stream) for _ in range(LIMIT + 1)]
        for call in services:
            assert (await call.read()).stream_id == stream
        # a closed follow frees its place (the server notices the cancel soon after)
        held[0].cancel()
        for _ in range(100):
            again: Any = _follow(alpha, stream)
            try:
                assert (await again.read()).stream_id == stream
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the cancelled follow's place was never freed")
        for call in [*held, again, beta_call, *services]:
            call.cancel()
