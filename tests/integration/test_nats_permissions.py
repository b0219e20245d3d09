"""kiln's NATS users against a real nats-server run with the configuration ``kiln up`` writes
(:mod:`kiln.embedded.nats_auth`): each service can do its job through its own code (the
ledger's outbox, the board, the registry, the engine pool's work consumer), and the review's
drills (issue 14) are refused: no anonymous or wrong-password connection, and no user but the
engine pool claims work items, none but the agent runner publishes work or board posts, none
but the ledger publishes events, nobody deletes a stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from kiln.board import Board
from kiln.common import nats as kn
from kiln.common.errors import Unauthenticated
from kiln.common.settings import KilnSettings
from kiln.embedded.nats import EmbeddedNats
from kiln.embedded.nats_auth import NATS_USERS, NatsPasswords
from kiln.engine_pool.registry import PoolRecord, Registry
from kiln.engine_pool.settings import EngineSettings
from kiln.ledger.app import LedgerApp
from kiln.ledger.events_feed import EventsFeed
from kiln.ledger.model import NewEvent

from ..databases import scratch_database
from ..pki import ServiceLedger
from ..unit.runtime_app import free_port
from .serving import serve_in_task

pytestmark = [pytest.mark.integration, pytest.mark.embedded]

DENIED_WAIT_S = 0.5
"""How long a refused JetStream request is given before it counts as unanswered, seconds."""


class Server:
    """The NATS with kiln's users for one prefix, and the users' passwords."""

    def __init__(self, url: str, prefix: str, passwords: NatsPasswords) -> None:
        self.url = url
        self.prefix = prefix
        self.passwords = passwords

    def credentials(self, user: str) -> tuple[str, str]:
        found = self.passwords.credentials(user)
        assert found is not None
        return found

    async def service(self, user: str) -> Client:
        """A connection as ``user`` through the services' own connect."""
        return await kn.connect(self.url, f"test-{user}", credentials=self.credentials(user))

    async def raw(self, user: str, errors: list[str]) -> Client:
        """A connection as ``user`` that records the server's errors (permission violations)."""

        async def record(exc: Exception) -> None:
            errors.append(str(exc))

        return await nats.connect(
            self.url,
            user=user,
            password=self.credentials(user)[1],
            inbox_prefix=kn.inbox_prefix(user),
            error_cb=record,
            allow_reconnect=False,
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    base = Path(tmp_path_factory.mktemp("nats-auth"))
    prefix = "kp" + uuid.uuid4().hex[:10]
    passwords = NatsPasswords(base / "credentials")
    nats_server = EmbeddedNats(base / "nats", free_port(), passwords=passwords, prefix=prefix)
    url = nats_server.start()
    try:
        yield Server(url, prefix, passwords)
    finally:
        nats_server.stop()


@pytest_asyncio.fixture(scope="module")
async def streams(server: Server) -> AsyncIterator[Server]:
    """The streams, each declared by its owner as the services do."""
    for user in ("ledger", "agent-runner"):
        nc = await server.service(user)
        try:
            kinds = kn.owned_streams(user, open_server=False)
            await kn.ensure_streams(nc.jetstream(), server.prefix, kinds)
        finally:
            await nc.close()
    yield server


def _settings(server: Server, user: str, **more: object) -> KilnSettings:
    return KilnSettings(
        nats_url=server.url,
        nats_user=user,
        nats_password_file=server.passwords.path(user),
        subject_prefix=server.prefix,
        metrics_port=0,
        grace_period_s=1.0,
        log_format="console",
        **more,  # type: ignore[arg-type]
    )


async def _messages(server: Server, kind: kn.StreamKind) -> int:
    nc = await server.service("agent-runner" if kind != "events" else "ledger")
    try:
        info = await nc.jetstream().stream_info(kn.stream_name(server.prefix, kind))
        return int(info.state.messages)
    finally:
        await nc.close()


# --- who gets in -----------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_no_connection_without_a_user_and_its_password(server: Server) -> None:
    with pytest.raises(Unauthenticated, match="without credentials"):
        await kn.connect(server.url, "anonymous", attempts=1)
    with pytest.raises(Unauthenticated, match="'engine-pool'"):
        await kn.connect(server.url, "wrong", credentials=("engine-pool", "guess"), attempts=1)
    with pytest.raises(Unauthenticated, match="'admin'"):
        await kn.connect(server.url, "unknown", credentials=("admin", "admin"), attempts=1)
    for user in NATS_USERS:  # and every user with its password does get in
        nc = await server.service(user)
        assert (await nc.jetstream().account_info()).streams >= 0
        await nc.close()


def test_passwords_are_private_and_kept(server: Server) -> None:
    before = {u: server.credentials(u) for u in NATS_USERS}
    assert server.passwords.ensure() == {u: p for u, (_, p) in before.items()}
    assert server.passwords.directory.stat().st_mode & 0o777 == 0o700
    for user in NATS_USERS:
        assert server.passwords.path(user).stat().st_mode & 0o777 == 0o600
    assert len(set(before.values())) == len(NATS_USERS)


# --- each service does its job ---------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_ledger_publishes_events_and_the_cli_follows_them(
    streams: Server, postgres_server_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with scratch_database(postgres_server_url, "kiln_nats_auth") as db_url:
        cfg = _settings(streams, "ledger", database_url=db_url, team="nats-auth")
        task, addr = await serve_in_task(LedgerApp(cfg), cfg)
        stream = f"compilation-{uuid.uuid4().hex[:12]}"
        event = NewEvent(
            "CompilationSubmitted",
            {
                "workload_key": "wk",
                "model_name": "tiny",
                "hardware": "cpu",
                "workload": {},
                "budget": {"wall_seconds": 60},
            },
        )
        try:
            async with ServiceLedger(addr, "nats-auth") as ledger:  # appends as the runner
                await ledger.append(stream, [event], "no_stream")
            cli = await streams.service("cli")  # the outbox publishes as the ledger user
            try:
                feed = EventsFeed(cli.jetstream(), streams.prefix, stream_id=stream, start="all")
                async with feed:
                    published = await asyncio.wait_for(anext(feed), 30)
            finally:
                await cli.close()
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert published.event.event_id == event.event_id
    assert "permissions violation" not in caplog.text.lower()


@pytest.mark.asyncio
async def test_the_agent_runner_posts_claims_and_reads_the_board_and_queues_work(
    streams: Server, caplog: pytest.LogCaptureFixture
) -> None:
    nc = await streams.service("agent-runner")
    try:
        board = Board(nc.jetstream(), streams.prefix)
        cid = "c" + uuid.uuid4().hex[:8]
        idea = await board.post_idea(cid, "cand1", "alpha", {"why": "test"})
        assert await board.claim(cid, "cand1", "alpha")
        assert not await board.claim(cid, "cand1", "beta")
        assert await board.claim_holder(cid, "cand1") == "alpha"
        assert await board.claimed(cid) == {"cand1"}
        assert [p.kind for p in await board.history(cid)] == ["idea", "claim"]
        follow = board.follow(cid, ["idea"])
        assert (await asyncio.wait_for(anext(follow), 10)).seq == idea.seq
        await follow.aclose()

        subject = kn.work_subject(streams.prefix, "cpu", "fast", "m" + uuid.uuid4().hex[:8])
        ack = await nc.jetstream().publish(
            subject, b"{}", stream=kn.work_stream_name(streams.prefix), headers={kn.MSG_ID: cid}
        )
        assert ack.stream == kn.work_stream_name(streams.prefix)
    finally:
        await nc.close()
    assert "permissions violation" not in caplog.text.lower()


@pytest.mark.asyncio
async def test_the_engine_pool_takes_work_acks_it_and_keeps_its_registry(
    streams: Server, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = streams.prefix
    work = kn.work_stream_name(prefix)
    subject = kn.work_subject(prefix, "cpu", "fast", "m" + uuid.uuid4().hex[:8])
    pool = await streams.service("engine-pool")
    runner = await streams.service("agent-runner")
    try:
        js = pool.jetstream()
        await kn.wait_for_streams(js, prefix, ("work",))  # the agent runner created it
        seen: list[str] = []

        async def count(msg: Msg) -> None:
            seen.append(msg.subject)

        await pool.subscribe(kn.work_filter(prefix), cb=count)  # what the queue counts with
        durable = "ep-test-" + uuid.uuid4().hex[:8]
        config = ConsumerConfig(
            durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT
        )
        await js.add_consumer(work, config)
        sub = await js.pull_subscribe_bind(durable=durable, stream=work)
        await runner.jetstream().publish(subject, b"{}", stream=work)
        (msg,) = await sub.fetch(1, timeout=5)
        await msg.in_progress()
        await msg.nak(delay=0.1)
        (again,) = await sub.fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2
        await again.ack_sync(timeout=5)
        info = await js.stream_info(work, subjects_filter=subject)
        assert not (info.state.subjects or {}).get(subject)  # a work queue: acked = gone
        assert seen == [subject]

        def registry(pool_id: str) -> Registry:
            def record(ttl_s: float) -> PoolRecord:
                return PoolRecord(pool_id, "host", 1, 0.0, time.time(), ttl_s)

            settings = EngineSettings(registry_ttl_s=30.0, heartbeat_s=0.5)
            return Registry(_settings(streams, "engine-pool"), settings, record)

        pools = [registry("pool-a"), registry("pool-b")]  # each reads the other's record
        stop = asyncio.Event()
        running = [asyncio.create_task(r.run(stop)) for r in pools]
        try:
            for r in pools:
                await asyncio.wait_for(r.connected.wait(), 20)
            seen_ids: list[str] = []
            for _ in range(100):  # until both have written their first record
                seen_ids = [r.pool_id for r in await pools[0].pools()]
                if len(seen_ids) == 2:
                    break
                await asyncio.sleep(0.2)
            assert seen_ids == ["pool-a", "pool-b"]
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(*running), 20)
    finally:
        await pool.close()
        await runner.close()
    assert "permissions violation" not in caplog.text.lower()


# --- the drills ------------------------------------------------------------------------------
SERVICE_USERS = [u for u in NATS_USERS if u != "operator"]
"""Every user but ``operator``, the deployment's owner (its own test below)."""
OTHERS = [u for u in SERVICE_USERS if u != "engine-pool"]


@pytest.mark.asyncio
@pytest.mark.parametrize("user", OTHERS)
async def test_only_the_engine_pool_claims_work_items(streams: Server, user: str) -> None:
    prefix = streams.prefix
    work = kn.work_stream_name(prefix)
    subject = kn.work_subject(prefix, "cpu", "fast", "m" + uuid.uuid4().hex[:8])
    durable = "ep-drill-" + uuid.uuid4().hex[:8]
    pool = await streams.service("engine-pool")
    runner = await streams.service("agent-runner")
    errors: list[str] = []
    other = await streams.raw(user, errors)
    try:
        config = ConsumerConfig(
            durable_name=durable, filter_subject=subject, ack_policy=AckPolicy.EXPLICIT
        )
        await pool.jetstream().add_consumer(work, config)
        await runner.jetstream().publish(subject, b"{}", stream=work)
        ojs = other.jetstream(timeout=DENIED_WAIT_S)
        with pytest.raises(nats.errors.TimeoutError):  # the pool's consumer
            sub = await ojs.pull_subscribe_bind(durable=durable, stream=work)
            await sub.fetch(1, timeout=DENIED_WAIT_S)
        with pytest.raises(nats.errors.TimeoutError):  # a consumer of its own
            await ojs.add_consumer(work, ConsumerConfig(durable_name="mine", filter_subject=">"))
        await other.subscribe(kn.work_filter(prefix))  # reading the items as they pass
        await other.subscribe(f"{kn.inbox_prefix('engine-pool')}.>")  # or as they are delivered
        await other.flush()
        await asyncio.sleep(0.2)
        sub = await pool.jetstream().pull_subscribe_bind(durable=durable, stream=work)
        (msg,) = await sub.fetch(1, timeout=5)  # still the pool's, never delivered before
        assert msg.metadata.num_delivered == 1
        await msg.ack_sync(timeout=5)
        refused = [e.lower() for e in errors if "permissions violation" in e.lower()]
        for what in (
            f'publish to "$js.api.consumer.msg.next.{work}.{durable}"',
            f'publish to "$js.api.consumer.durable.create.{work}.mine"',
            f'subscription to "{kn.work_filter(prefix)}"',
            'subscription to "_inbox.engine-pool.>"',
        ):
            assert any(what.lower() in e for e in refused), (what, errors)
    finally:
        for nc in (pool, runner, other):
            await nc.close()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("kind", "subject_of"),
    [
        ("work", lambda p: kn.work_subject(p, "cpu", "fast", "evil")),
        ("board", lambda p: kn.board_subject(p, "c1", "claim", "cand1")),
        ("events", lambda p: kn.events_subject(p, "compilation-c1", "BestCandidateImproved")),
    ],
)
async def test_only_the_owner_publishes_to_a_stream(
    streams: Server, kind: kn.StreamKind, subject_of: object
) -> None:
    subject = subject_of(streams.prefix)  # type: ignore[operator]
    publisher = "ledger" if kind == "events" else "agent-runner"
    before = await _messages(streams, kind)
    for user in (u for u in SERVICE_USERS if u != publisher):
        errors: list[str] = []
        nc = await streams.raw(user, errors)
        try:
            await nc.publish(subject, b"{}")
            with pytest.raises(nats.errors.TimeoutError):
                await nc.jetstream(timeout=DENIED_WAIT_S).publish(subject, b"{}")
            await nc.flush()
        finally:
            await nc.close()
        assert any("permissions violation for publish" in e.lower() for e in errors), errors
    assert await _messages(streams, kind) == before


@pytest.mark.asyncio
@pytest.mark.parametrize("user", NATS_USERS)
async def test_nobody_deletes_streams_and_only_owners_create_them(
    streams: Server, user: str
) -> None:
    errors: list[str] = []
    nc = await streams.raw(user, errors)
    js = nc.jetstream(timeout=DENIED_WAIT_S)
    prefix = streams.prefix
    try:
        for kind in kn.STREAM_KINDS:
            with pytest.raises(nats.errors.TimeoutError):
                await js.delete_stream(kn.stream_name(prefix, kind))
            with pytest.raises(nats.errors.TimeoutError):
                await js.purge_stream(kn.stream_name(prefix, kind))
            if kn.STREAM_OWNERS[kind] != user and user != "operator":
                with pytest.raises(nats.errors.TimeoutError):
                    await kn.ensure_streams(js, prefix, (kind,))
        if user != "operator":  # the owner of the deployment may make streams
            with pytest.raises(nats.errors.TimeoutError):  # one capturing the work subjects
                await js.add_stream(StreamConfig(name="EVIL", subjects=[f"{prefix}.work.>"]))
    finally:
        await nc.close()
    for kind in kn.STREAM_KINDS:  # all still there
        assert await _messages(streams, kind) >= 0


@pytest.mark.asyncio
async def test_the_cli_cannot_redirect_the_events_into_the_work_queue(streams: Server) -> None:
    """A push consumer the cli creates on the events stream may deliver only where the cli may
    subscribe: one aimed at the work subjects delivers nothing there."""
    prefix = streams.prefix
    ledger = await streams.service("ledger")
    errors: list[str] = []
    cli = await streams.raw("cli", errors)
    before = await _messages(streams, "work")
    try:
        await ledger.jetstream().publish(
            kn.events_subject(prefix, "compilation-c2", "CompilationSubmitted"), b"{}"
        )
        target = kn.work_subject(prefix, "cpu", "fast", "evil")
        config = ConsumerConfig(deliver_subject=target, deliver_policy=DeliverPolicy.ALL)
        try:
            await cli.jetstream(timeout=2.0).add_consumer(kn.events_stream_name(prefix), config)
        except (nats.errors.TimeoutError, nats.js.errors.APIError):
            pass  # refused outright: as good
        await asyncio.sleep(1.0)
    finally:
        await ledger.close()
        await cli.close()
    assert await _messages(streams, "work") == before


@pytest.mark.asyncio
async def test_the_operator_inspects_every_stream_and_its_consumers(streams: Server) -> None:
    """The deployment's owner reads what no service may (every stream's consumers: the recovery
    drill counts redeliveries this way); deleting is refused above."""
    nc = await streams.service("operator")
    try:
        js = nc.jetstream(timeout=5.0)
        for kind in kn.STREAM_KINDS:
            name = kn.stream_name(streams.prefix, kind)
            assert (await js.stream_info(name)).config.name == name
            assert isinstance(await js.consumers_info(name), list)
    finally:
        await nc.close()
