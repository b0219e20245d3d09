"""The ledger service over real gRPC (in-process server, real PostgreSQL and NATS)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from kiln.common.client import channel, team_channel
from kiln.common.errors import Aborted, InvalidArgument, NotFound
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.ledger.app import LedgerApp
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent
from kiln.v1 import ledger_pb2, ledger_pb2_grpc

from ..pki import ServiceLedger, service_tls
from .events_factory import compilation_story, new_id, submitted

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest_asyncio.fixture(scope="module")
async def ledger_addr(settings: KilnSettings) -> AsyncIterator[str]:
    addr = f"127.0.0.1:{_free_port()}"
    cfg = settings.model_copy(update={"metrics_port": 0, "grace_period_s": 1.0})
    started = asyncio.Event()
    task = asyncio.create_task(
        serve(LedgerApp(cfg), cfg, listen=addr, started=started, handle_signals=False)
    )
    await asyncio.wait_for(started.wait(), 20)
    yield addr
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest_asyncio.fixture
async def client(ledger_addr: str) -> AsyncIterator[LedgerClient]:
    async with ServiceLedger(ledger_addr, "search") as c:  # writes as the services do
        yield c  # type: ignore[misc]


async def test_append_and_read_back_records_team_and_correlation(client: LedgerClient) -> None:
    cid = new_id()
    result = await client.append(f"compilation-{cid}", [submitted()], "no_stream")
    assert result.stream_version == 1
    (event,) = await client.read_stream(f"compilation-{cid}")
    assert event.position == result.positions[0]
    assert event.metadata.team == "search"
    assert event.metadata.principal == "spiffe://kiln/service/agent-runner"
    assert event.metadata.correlation_id == event.event_id
    assert json.loads(event.data)["model_name"] == "llama-3.2-1b"
    assert event.stream_id == f"compilation-{cid}"


async def test_bad_input_gets_the_right_status_and_stores_nothing(client: LedgerClient) -> None:
    cid = new_id()
    stream = f"compilation-{cid}"
    await client.append(stream, [submitted()])
    with pytest.raises(NotFound, match="has no events"):
        await client.read_stream(f"compilation-{new_id()}")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        await client.append(stream, [NewEvent("CompilationEnded", b"{oops")])
    with pytest.raises(InvalidArgument, match="has no registered schema"):
        await client.append(stream, [NewEvent("Mystery", {})])
    with pytest.raises(InvalidArgument, match="bytes; the limit is"):
        await client.append(
            stream, [NewEvent("CompilationEnded", {"status": "failed", "reason": "x" * (2 << 20)})]
        )
    with pytest.raises(Aborted, match="stream is at version 1"):
        await client.append(stream, [NewEvent("CompilationEnded", {"status": "failed"})], 5)
    events = await client.read_stream(stream)
    assert [e.type for e in events] == ["CompilationSubmitted"]


async def test_a_service_naming_no_team_is_unauthenticated(ledger_addr: str) -> None:
    async with channel(ledger_addr, tls=service_tls("agent-runner")) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ReadStream(ledger_pb2.ReadStreamRequest(stream_id="compilation-x"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "kiln-team" in (info.value.details() or "")


async def test_read_all_follow_streams_events_as_they_commit(client: LedgerClient) -> None:
    cid = new_id()
    got: list[str] = []

    async def follow() -> None:
        async for ev in client.read_all(stream_prefix=f"compilation-{cid}", follow=True):
            got.append(ev.type)
            if len(got) == 2:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await client.append(f"compilation-{cid}", [submitted()])
    await client.append(
        f"compilation-{cid}", [NewEvent("CompilationEnded", {"status": "cancelled"})]
    )
    await asyncio.wait_for(task, 10)
    assert got == ["CompilationSubmitted", "CompilationEnded"]


async def test_query_and_replay_over_grpc(client: LedgerClient) -> None:
    import random

    cid, wk = new_id(), f"wk-{new_id()}"
    for stream, evs in compilation_story(random.Random(7), cid, wk, n_experiments=5):
        await client.append(stream, evs)
    rows: list[dict] = []
    for _ in range(100):  # the projector runs in the service; wait for it to catch up
        rows = await client.query("compilations", {"compilation_id": cid})
        if rows and rows[0]["status"] == "succeeded":
            break
        await asyncio.sleep(0.05)
    assert rows and rows[0]["status"] == "succeeded" and rows[0]["team"] == "search"
    exps = await client.query("experiments", {"compilation_id": cid}, limit=0)
    assert len(exps) == 5
    with pytest.raises(InvalidArgument, match="no column 'nope'"):
        await client.query("experiments", {"nope": "1"})
    report = await client.replay()
    assert report.equal
    assert {p.name for p in report.projections} == {
        "compilations",
        "experiments",
        "best_candidates",
    }


async def test_append_requires_client_chosen_event_ids(ledger_addr: str) -> None:
    async with team_channel(ledger_addr, "search", tls=service_tls("agent-runner")) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        request = ledger_pb2.AppendRequest(
            stream_id=f"compilation-{new_id()}",
            events=[ledger_pb2.EventData(type="CompilationEnded", data=b'{"status": "failed"}')],
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Append(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "event_id is required" in (info.value.details() or "")


async def test_read_all_rejects_unknown_type_filters(client: LedgerClient) -> None:
    with pytest.raises(InvalidArgument, match="unknown event type"):
        async for _ in client.read_all(types=["Nope"]):
            pass


async def test_query_pages_types_and_filters(client: LedgerClient, ledger_addr: str) -> None:
    wk = f"wk-{new_id()}"
    # Created in the reverse of id order: rows are listed (and paged) oldest first.
    cids = sorted((new_id() for _ in range(5)), reverse=True)
    for cid in cids:
        await client.append(f"compilation-{cid}", [submitted(wk)])
    rows: list[dict] = []
    for _ in range(100):
        rows = await client.query("compilations", {"workload_key": wk}, limit=0)
        if len(rows) == 5:
            break
        await asyncio.sleep(0.05)
    assert [r["compilation_id"] for r in rows] == cids
    assert rows[0]["experiments_done"] == 0 and isinstance(rows[0]["experiments_done"], int)
    created = rows[0]["created_at"]
    same = await client.query("compilations", {"created_at": created})
    assert [r["compilation_id"] for r in same] == [cids[0]]
    with pytest.raises(InvalidArgument, match="ISO 8601"):
        await client.query("compilations", {"created_at": "yesterday"})
    async with team_channel(ledger_addr, "search") as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        first = await stub.Query(
            ledger_pb2.QueryRequest(
                projection=ledger_pb2.PROJECTION_COMPILATIONS, filter={"workload_key": wk}, limit=2
            )
        )
        assert len(first.rows_json) == 2 and first.next_page_token
        second = await stub.Query(
            ledger_pb2.QueryRequest(
                projection=ledger_pb2.PROJECTION_COMPILATIONS,
                filter={"workload_key": wk},
                limit=2,
                page_token=first.next_page_token,
            )
        )
        got = [json.loads(r)["compilation_id"] for r in [*first.rows_json, *second.rows_json]]
        assert got == cids[:4]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Query(
                ledger_pb2.QueryRequest(
                    projection=ledger_pb2.PROJECTION_EXPERIMENTS,
                    page_token=first.next_page_token,
                )
            )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "another query" in (info.value.details() or "")


async def test_followers_get_unavailable_when_the_ledger_shuts_down(settings: KilnSettings) -> None:
    from kiln.common.errors import Unavailable

    addr = f"127.0.0.1:{_free_port()}"
    cfg = settings.model_copy(update={"metrics_port": 0, "grace_period_s": 5.0})
    started = asyncio.Event()
    server = asyncio.create_task(
        serve(LedgerApp(cfg), cfg, listen=addr, started=started, handle_signals=False)
    )
    await asyncio.wait_for(started.wait(), 20)
    async with LedgerClient(addr, team="search") as c:
        head = 0
        async for ev in c.read_all(max_count=0, follow=False):
            head = ev.position

        async def follow() -> None:
            async for _ in c.read_all(after_position=head, follow=True):
                pass

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.3)
        t0 = asyncio.get_running_loop().time()
        server.cancel()
        with pytest.raises(Unavailable, match="resume with after_position"):
            await asyncio.wait_for(follower, 10)
        assert asyncio.get_running_loop().time() - t0 < 4, "the follower held up shutdown"
    with pytest.raises(asyncio.CancelledError):
        await server
