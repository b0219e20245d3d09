"""Projections: live projector vs replay from the events, on real PostgreSQL."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.ledger.db import create_engine
from kiln.ledger.model import NewEvent
from kiln.ledger.projections.projector import Projector
from kiln.ledger.replay import replay
from kiln.ledger.store import EventStore
from kiln.ledger.tables import proj_best_candidates, proj_compilations, proj_experiments

from ..databases import scratch_database
from .events_factory import compilation_story, new_id

pytestmark = pytest.mark.integration


async def _write_stories(store: EventStore, seed: int, n: int, workload_key: str) -> list[str]:
    rng = random.Random(seed)
    ids = []
    for _ in range(n):
        cid = new_id()
        ids.append(cid)
        for stream, evs in compilation_story(rng, cid, workload_key, n_experiments=12):
            await store.append(stream, evs, "any", team="search")
    return ids


async def test_projector_builds_rows_that_match_the_story(
    store: EventStore, engine: AsyncEngine
) -> None:
    wk = f"wk-{new_id()}"
    ids = await _write_stories(store, seed=1, n=3, workload_key=wk)
    await Projector(engine, batch_size=37).catch_up()
    async with engine.connect() as conn:
        comps = {
            r.compilation_id: r
            for r in await conn.execute(
                select(proj_compilations).where(proj_compilations.c.workload_key == wk)
            )
        }
        exps = (
            await conn.execute(
                select(proj_experiments).where(proj_experiments.c.compilation_id.in_(ids))
            )
        ).all()
        best = (
            await conn.execute(
                select(proj_best_candidates).where(proj_best_candidates.c.workload_key == wk)
            )
        ).one()
    assert set(comps) == set(ids)
    assert all(c.status == "succeeded" and c.experiments_done == 12 for c in comps.values())
    assert len(exps) == 36
    for cid, comp in comps.items():
        mine = [e for e in exps if e.compilation_id == cid]
        assert comp.failures == sum(e.status != "ok" for e in mine)
        ok = [e.tokens_per_s for e in mine if e.status == "ok" and e.tokens_per_s > 100.0]
        assert comp.best_tokens_per_s == (max(ok) if ok else None)
    assert best.tokens_per_s == max(c.best_tokens_per_s or 0 for c in comps.values())


async def test_replay_rebuild_equals_live(store: EventStore, engine: AsyncEngine) -> None:
    await _write_stories(store, seed=2, n=4, workload_key=f"wk-{new_id()}")
    await Projector(engine).catch_up()
    report = await replay(engine)
    assert report.equal, [p.differences for p in report.projections]
    assert report.checkpoint_position == await store.head_position()
    assert report.events_replayed > 0
    assert {p.name for p in report.projections} == {
        "compilations",
        "experiments",
        "best_candidates",
    }
    assert all(p.rows_live == p.rows_rebuilt > 0 for p in report.projections)


async def test_replay_detects_a_corrupted_projection_and_apply_repairs_it(
    store: EventStore, engine: AsyncEngine
) -> None:
    ids = await _write_stories(store, seed=3, n=1, workload_key=f"wk-{new_id()}")
    await Projector(engine).catch_up()
    async with engine.begin() as conn:
        await conn.execute(
            text("UPDATE proj_compilations SET experiments_done = 999 WHERE compilation_id = :c"),
            {"c": ids[0]},
        )
    report = await replay(engine, names=["compilations"])
    assert not report.equal
    (diff,) = report.projections
    assert any(ids[0] in d and "experiments_done=999" in d for d in diff.differences)
    fixed = await replay(engine, apply=True)
    assert [p.name for p in fixed.projections if p.applied] == ["compilations"]
    assert (await replay(engine)).equal


async def test_projector_and_checkpoint_advance_atomically(
    store: EventStore, engine: AsyncEngine
) -> None:
    cid = new_id()
    await store.append(
        f"compilation-{cid}", [NewEvent("CompilationEnded", {"status": "failed"})], "any", team="t"
    )
    projector = Projector(engine)
    await projector.catch_up()
    assert await projector.run_once() == 0  # caught up: nothing folded twice
    report = await replay(engine)
    assert report.equal


async def test_replay_rejects_unknown_projection(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="unknown projection"):
        await replay(engine, names=["nope"])


async def _raw_append(engine: AsyncEngine, stream: str, type_: str, data: dict) -> int:
    """Append bypassing validation (as an older or buggy writer might have), under the append
    lock so positions stay in commit order."""
    import json
    import uuid

    from kiln.ledger.group_commit import APPEND_LOCK_KEY

    async with engine.begin() as conn:
        await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": APPEND_LOCK_KEY})
        version = await conn.scalar(
            text("SELECT coalesce(max(stream_version), 0) + 1 FROM events WHERE stream_id = :s"),
            {"s": stream},
        )
        return int(
            await conn.scalar(
                text(
                    "INSERT INTO events (position, stream_id, stream_version, event_id, type, "
                    "schema_version, data, metadata) VALUES (nextval('events_position_seq'), :s, "
                    ':v, :e, :t, 1, CAST(:d AS jsonb), \'{"team": "old"}\') RETURNING position'
                ),
                {
                    "s": stream,
                    "v": version,
                    "e": str(uuid.uuid4()),
                    "t": type_,
                    "d": json.dumps(data),
                },
            )
        )


async def test_a_poison_event_is_quarantined_and_projection_goes_on(
    postgres_server_url: str,
) -> None:
    # Its own database: the quarantined event leaves replay unequal for good.
    with scratch_database(postgres_server_url) as url:
        engine = create_engine(url)
        store = EventStore(engine)
        try:
            await _poison_scenario(store, engine)
        finally:
            await store.close()
            await engine.dispose()


async def _poison_scenario(store: EventStore, engine: AsyncEngine) -> None:
    cid = new_id()
    # A fold error (no "status"): skipped live and in replay alike.
    bad_fold = await _raw_append(engine, f"experiment-{new_id()}", "ExperimentCompleted", {"x": 1})
    # A value the projection table cannot hold (bigint overflow): quarantined live only.
    huge = {
        "workload_key": "w",
        "model_name": "m",
        "hardware": "h",
        "workload": {},
        "budget": {"wall_seconds": 1, "max_experiments": 2**70},
    }
    bad_db = await _raw_append(engine, f"compilation-{new_id()}", "CompilationSubmitted", huge)
    for stream, evs in compilation_story(random.Random(5), cid, f"wk-{new_id()}", n_experiments=2):
        await store.append(stream, evs, "any", team="t")
    await Projector(engine).catch_up()
    async with engine.connect() as conn:
        quarantined = set(
            (await conn.execute(text("SELECT position FROM projection_failures"))).scalars()
        )
        status = await conn.scalar(
            select(proj_compilations.c.status).where(proj_compilations.c.compilation_id == cid)
        )
    assert {bad_fold, bad_db} <= quarantined
    assert status == "succeeded", "events after the poison ones were not projected"
    report = await replay(engine)
    (comp,) = [p for p in report.projections if p.name == "compilations"]
    assert not comp.equal and any(
        "9223372036854775807" in d or str(2**70) in d for d in comp.differences
    )


async def test_cancelled_experiments_are_neither_done_nor_failures(
    store: EventStore, engine: AsyncEngine
) -> None:
    from .events_factory import completed, requested, submitted

    cid, wk = new_id(), f"wk-{new_id()}"
    await store.append(f"compilation-{cid}", [submitted(wk)], "no_stream", team="t")
    for status in ("ok", "crashed", "cancelled"):
        exp, cand = new_id(), new_id()
        done = completed(cid, exp, cand, 100.0, ok=status == "ok")
        data = dict(done.data) | {"status": status}  # type: ignore[arg-type]
        await store.append(
            f"experiment-{exp}",
            [requested(cid, exp, cand), NewEvent("ExperimentCompleted", data)],
            "no_stream",
            team="t",
        )
    await Projector(engine).catch_up()
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(proj_compilations).where(proj_compilations.c.compilation_id == cid)
            )
        ).one()
    assert (row.experiments_done, row.failures) == (2, 1)
