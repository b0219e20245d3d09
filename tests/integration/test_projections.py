"""Projections: live projector vs replay from the events, on real PostgreSQL."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.ledger.model import NewEvent
from kiln.ledger.projections.projector import Projector
from kiln.ledger.replay import replay
from kiln.ledger.store import EventStore
from kiln.ledger.tables import proj_best_candidates, proj_compilations, proj_experiments

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
