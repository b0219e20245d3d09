"""EventStore.append against real PostgreSQL: versions, idempotency, bad input."""

from __future__ import annotations

import json
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from kiln.common.errors import Aborted, AlreadyExists, InvalidArgument, NotFound
from kiln.ledger.model import NewEvent
from kiln.ledger.store import EventStore

from .events_factory import completed, new_id, requested, submitted

pytestmark = pytest.mark.integration


async def test_append_assigns_versions_positions_and_metadata(store: EventStore) -> None:
    cid = new_id()
    stream = f"compilation-{cid}"
    first = await store.append(
        stream, [submitted()], "no_stream", team="search", correlation_id="corr-1"
    )
    second = await store.append(
        stream,
        [NewEvent("CompilationPlanned", {"plan": {"tp": 2}}, causation_id="cause-9")],
        1,
        team="search",
    )
    assert first.stream_version == 1 and second.stream_version == 2
    assert second.positions[0] > first.positions[0]
    events, version = await store.read_stream(stream)
    assert version == 2
    assert [e.stream_version for e in events] == [1, 2]
    assert [e.type for e in events] == ["CompilationSubmitted", "CompilationPlanned"]
    assert events[0].metadata == {
        "team": "search",
        "correlation_id": "corr-1",
        "causation_id": None,
    }
    assert events[1].metadata["causation_id"] == "cause-9"
    assert events[1].metadata["correlation_id"] == events[1].event_id
    assert events[1].data == {"plan": {"tp": 2}}


async def test_expected_version_conflicts_are_aborted_and_change_nothing(store: EventStore) -> None:
    cid = new_id()
    stream = f"compilation-{cid}"
    with pytest.raises(Aborted, match="expected an existing stream"):
        await store.append(stream, [submitted()], "stream_exists", team="t")
    await store.append(stream, [submitted()], "no_stream", team="t")
    with pytest.raises(Aborted, match="expected no stream, but the stream is at version 1"):
        await store.append(
            stream, [NewEvent("CompilationPlanned", {"plan": {}})], "no_stream", team="t"
        )
    with pytest.raises(Aborted, match="expected version 3, but the stream is at version 1"):
        await store.append(stream, [NewEvent("CompilationPlanned", {"plan": {}})], 3, team="t")
    assert await store.stream_version(stream) == 1


async def test_reappending_same_events_returns_original_positions(store: EventStore) -> None:
    cid, exp, cand = new_id(), new_id(), new_id()
    stream = f"experiment-{exp}"
    batch = [requested(cid, exp, cand), completed(cid, exp, cand, 123.0)]
    first = await store.append(stream, batch, "no_stream", team="t")
    # A retry of the very same batch, even with a now-stale expected version, is a no-op.
    again = await store.append(stream, batch, "no_stream", team="t")
    assert again.already_stored and not first.already_stored
    assert again.positions == first.positions
    assert again.stream_version == 2
    events, _ = await store.read_stream(stream)
    assert len(events) == 2


async def test_event_id_reused_with_other_content_is_already_exists(store: EventStore) -> None:
    cid = new_id()
    ev = submitted()
    await store.append(f"compilation-{cid}", [ev], "any", team="t")
    forged = NewEvent(ev.type, {**ev.data, "workload_key": "other"}, event_id=ev.event_id)  # type: ignore[dict-item]
    with pytest.raises(AlreadyExists, match=ev.event_id):
        await store.append(f"compilation-{cid}", [forged], "any", team="t")
    partial = [ev, NewEvent("CompilationPlanned", {"plan": {}})]
    with pytest.raises(AlreadyExists, match="part of this batch"):
        await store.append(f"compilation-{cid}", partial, "any", team="t")
    assert await store.stream_version(f"compilation-{cid}") == 1


@pytest.mark.parametrize(
    ("stream", "event", "message"),
    [
        ("Compilation-x", NewEvent("CompilationEnded", {"status": "failed"}), "invalid stream id"),
        (
            "compilation-a.b",
            NewEvent("CompilationEnded", {"status": "failed"}),
            "invalid stream id",
        ),
        ("compilation-x", NewEvent("NoSuchThing", {}), "has no registered schema"),
        ("compilation-x", NewEvent("CompilationEnded", {"status": "maybe"}), "status"),
        ("compilation-x", NewEvent("CompilationEnded", {"status": "failed", "extra": 1}), "extra"),
        ("compilation-x", NewEvent("CompilationEnded", b"{not json"), "not valid JSON"),
        ("compilation-x", NewEvent("CompilationEnded", b"[1, 2]"), "must be a JSON object"),
        (
            "experiment-x",
            NewEvent("CompilationEnded", {"status": "failed"}),
            "belongs in 'compilation-\\*'",
        ),
        (
            "compilation-x",
            NewEvent("CompilationEnded", {"status": "failed"}, schema_version=9),
            "no schema version 9",
        ),
        (
            "compilation-x",
            NewEvent("CompilationEnded", {"status": "failed"}, event_id="nope"),
            "not a UUID",
        ),
        (
            "compilation-x",
            NewEvent("CompilationEnded", {"status": "failed", "reason": "x" * 70_000}),
            "payload is 700",
        ),
        # Storable JSON only: PostgreSQL's jsonb refuses these, so they must never reach it.
        (
            "compilation-x",
            NewEvent("CompilationEnded", b'{"status": "failed", "reason": "a\\u0000b"}'),
            "NUL",
        ),
        (
            "compilation-x",
            NewEvent("CompilationEnded", {"status": "failed", "reason": "\ud800"}),
            "surrogate",
        ),
        (
            "compilation-x",
            NewEvent("CompilationPlanned", b'{"plan": {"tp": NaN}}'),
            "not valid JSON",
        ),
        (
            "compilation-x",
            NewEvent("CompilationPlanned", b'{"plan": {"tp": Infinity}}'),
            "not valid JSON",
        ),
        (
            "compilation-x",
            NewEvent("CompilationPlanned", {"plan": {"tp": float("inf")}}),
            "non-finite",
        ),
        (
            "compilation-x",
            NewEvent("CompilationPlanned", b'{"plan": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
            "nested",
        ),
        (
            "compilation-x",
            NewEvent(
                "CompilationPlanned",
                {"plan": {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}},
            ),
            "levels deep",
        ),
        (
            "compilation-x",
            NewEvent(
                "CompilationSubmitted",
                {
                    "workload_key": "w",
                    "model_name": "m",
                    "hardware": "h",
                    "workload": {},
                    "budget": {"wall_seconds": 60, "max_experiments": 2**31},
                },
            ),
            "max_experiments",
        ),
    ],
)
async def test_bad_input_is_invalid_argument_and_stores_nothing(
    store: EventStore, stream: str, event: NewEvent, message: str
) -> None:
    head = await store.head_position()
    with pytest.raises(InvalidArgument, match=message):
        await store.append(stream, [event], "any", team="t")
    assert await store.head_position() == head


async def test_a_bad_event_rejects_the_whole_batch(store: EventStore) -> None:
    cid = new_id()
    with pytest.raises(InvalidArgument, match="event 1"):
        await store.append(
            f"compilation-{cid}",
            [submitted(), NewEvent("CompilationEnded", {"status": "nah"})],
            "any",
            team="t",
        )
    with pytest.raises(NotFound):
        await store.read_stream(f"compilation-{cid}")


async def test_duplicate_ids_in_one_batch_are_rejected(store: EventStore) -> None:
    eid = str(uuid.uuid4())
    evs = [NewEvent("CompilationPlanned", {"plan": {}}, event_id=eid)] * 2
    with pytest.raises(InvalidArgument, match="appears twice"):
        await store.append(f"compilation-{new_id()}", evs, "any", team="t")


async def test_events_table_refuses_update_and_delete(store: EventStore) -> None:
    cid = new_id()
    await store.append(f"compilation-{cid}", [submitted()], "any", team="t")
    for sql in (
        "UPDATE events SET type = 'X' WHERE stream_id = :s",
        "DELETE FROM events WHERE stream_id = :s",
    ):
        with pytest.raises(DBAPIError, match="append-only"):
            async with store.engine.begin() as conn:
                await conn.execute(text(sql), {"s": f"compilation-{cid}"})
    events, _ = await store.read_stream(f"compilation-{cid}")
    assert events[0].type == "CompilationSubmitted"


async def test_read_stream_of_unknown_stream_is_not_found(store: EventStore) -> None:
    with pytest.raises(NotFound, match="has no events"):
        await store.read_stream(f"compilation-{new_id()}")


async def test_payload_round_trips_as_json(store: EventStore) -> None:
    cid = new_id()
    raw = json.dumps({"status": "cancelled", "reason": "budget ünïcode ✓"}).encode()
    await store.append(f"compilation-{cid}", [NewEvent("CompilationEnded", raw)], "any", team="t")
    events, _ = await store.read_stream(f"compilation-{cid}")
    assert events[0].data == {"status": "cancelled", "reason": "budget ünïcode ✓", "outcome": ""}


async def test_a_failing_append_does_not_fail_the_others_of_its_group(store: EventStore) -> None:
    """A writer outside the ledger's lock holds version 1 of one stream, so the group's
    transaction fails on the unique key; the group is then committed append by append: the
    colliding append fails (Aborted: the stream exists now), the others of its group succeed."""
    import asyncio

    victim = f"compilation-{new_id()}"
    async with store.engine.connect() as raw:
        await raw.begin()
        await raw.execute(
            text(
                "INSERT INTO events (position, stream_id, stream_version, event_id, type, "
                "schema_version, data, metadata) VALUES (nextval('events_position_seq'), :s, 1, "
                ':e, \'CompilationEnded\', 1, \'{"status": "failed", "reason": ""}\', \'{}\')'
            ),
            {"s": victim, "e": str(uuid.uuid4())},
        )
        others = [f"compilation-{new_id()}" for _ in range(6)]
        ended = NewEvent("CompilationEnded", {"status": "cancelled"})
        tasks = [
            asyncio.create_task(
                store.append(s, [NewEvent(ended.type, ended.data)], "no_stream", team="t")
            )
            for s in [victim, *others]
        ]
        await asyncio.sleep(0.3)  # the group is now blocked on the uncommitted row's unique key
        await raw.commit()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], Aborted), results[0]
    assert all(not isinstance(r, BaseException) for r in results[1:]), results[1:]
    for s in others:
        events, version = await store.read_stream(s)
        assert version == 1 and events[0].type == "CompilationEnded"
