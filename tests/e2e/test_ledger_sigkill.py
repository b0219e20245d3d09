"""SIGKILL of the ledger service mid-burst, then restart: every acknowledged event is in
PostgreSQL and on JetStream exactly once, and retries of unacknowledged appends store nothing
twice. The ledger runs as a real ``kiln serve ledger`` process; real PostgreSQL and NATS."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import nats
import psycopg
import pytest

from kiln.common import nats as kn
from kiln.common.errors import KilnError
from kiln.common.settings import KilnSettings
from kiln.ledger.db import libpq_dsn
from kiln.ledger.model import NewEvent

from ..pki import ServiceLedger  # writes as the services do
from .processes import ServiceProcess, free_port, service_env

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


@pytest.fixture
def ledger(settings: KilnSettings, tmp_path: Path) -> Iterator[ServiceProcess]:
    addr = f"127.0.0.1:{free_port()}"
    env = service_env(
        str(settings.database_url),
        str(settings.nats_url),
        settings.subject_prefix,
        settings.state_dir,
        {"ledger": addr},
    )
    proc = ServiceProcess("ledger", addr, env, tmp_path / "ledger.log")
    yield proc
    proc.stop()


def _batch(stream: str, i: int) -> list[NewEvent]:
    return [
        NewEvent("CompilationCancelRequested", {"reason": f"{stream}/{i}/{k}"}) for k in range(3)
    ]


async def test_sigkill_mid_burst_loses_and_duplicates_nothing(
    ledger: ServiceProcess, settings: KilnSettings
) -> None:
    await ledger.start()
    acked: dict[str, int] = {}  # event id -> position the ledger acknowledged
    unacked: list[tuple[str, list[NewEvent]]] = []  # sent, outcome unknown
    killed = asyncio.Event()

    async def writer(w: int) -> None:
        stream = f"compilation-kill{w}-{uuid.uuid4().hex[:8]}"
        async with ServiceLedger(ledger.addr, "chaos", timeout_s=5) as client:
            i = 0
            while not killed.is_set():
                batch = _batch(stream, i)
                try:
                    result = await client.append(stream, batch)
                except KilnError:
                    unacked.append((stream, batch))
                    return
                acked.update(zip((e.event_id for e in batch), result.positions, strict=True))
                i += 1

    writers = [asyncio.create_task(writer(w)) for w in range(12)]
    await asyncio.sleep(1.5)
    ledger.kill()
    killed.set()
    await asyncio.gather(*writers)
    assert len(acked) > 50, "the burst was too small to mean anything"

    await ledger.start()
    async with ServiceLedger(ledger.addr, "chaos") as client:
        for stream, batch in unacked:  # a client retries what it never heard back about
            result = await client.append(stream, batch)
            acked.update(zip((e.event_id for e in batch), result.positions, strict=True))

    with psycopg.connect(libpq_dsn(str(settings.database_url))) as conn:
        rows = conn.execute(
            "SELECT event_id::text, position FROM events WHERE stream_id LIKE 'compilation-kill%%'"
        ).fetchall()
    stored = dict(rows)
    assert {eid: stored.get(eid) for eid in acked} == acked, "an acknowledged event is missing"

    nc = await nats.connect(str(settings.nats_url))
    try:
        js = nc.jetstream()
        name = kn.events_stream_name(settings.subject_prefix)
        counts: Counter[str] = Counter()
        for _ in range(200):  # wait for the restarted ledger's outbox to drain
            with psycopg.connect(libpq_dsn(str(settings.database_url))) as conn:
                pending = conn.execute("SELECT count(*) FROM outbox").fetchone()
            if pending and pending[0] == 0:
                break
            await asyncio.sleep(0.1)
        state = (await js.stream_info(name)).state
        for seq in range(state.first_seq, state.last_seq + 1):
            msg = await js.get_msg(name, seq=seq)
            if (msg.headers or {}).get(kn.H_STREAM_ID, "").startswith("compilation-kill"):
                counts[msg.headers[kn.MSG_ID]] += 1
    finally:
        await nc.close()
    assert set(counts) == set(stored), "events in PostgreSQL and on JetStream differ"
    assert max(counts.values()) == 1, "an event was published twice"
