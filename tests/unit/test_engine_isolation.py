"""Engines as real processes: a candidate that kills its process or never returns fails its
experiment, and the engine comes back for the next one."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kiln.common.errors import InvalidArgument
from kiln.engine_pool.pool import EnginePool
from kiln.workloads.candidate import Candidate

from .engine_testing import EXIT_AT_LOAD, SLEEPY_ATTENTION, engine_settings, tiny_workload, work


@pytest_asyncio.fixture(scope="module")
async def pool() -> AsyncIterator[EnginePool]:
    p = EnginePool(engine_settings(), host="test-host")
    try:
        yield p
    finally:
        await p.close()


async def test_first_experiment_builds_the_engine_in_a_clean_process(pool: EnginePool) -> None:
    m = await pool.measure(work(Candidate.make({"attention": "sdpa"})))
    assert m.status == "ok", m.error
    (engine,) = pool.engines()
    assert engine.state == "ready" and engine.experiments_run == 1
    assert engine.cold_start_s > 0 and engine.memory.weights_bytes > 0
    assert engine.engine_id == m.engine_id and engine.engine_id.endswith("@test-host")
    process = pool._engines[next(iter(pool._engines))]
    assert process.info["service_modules"] == []  # no grpc, nats, sqlalchemy in the engine


async def test_a_candidate_that_exits_crashes_and_the_engine_restarts(pool: EnginePool) -> None:
    before = pool.engines()[0].restarts
    m = await pool.measure(work(Candidate.make(code_modules=[EXIT_AT_LOAD])))
    assert m.status == "crashed"
    assert m.error.startswith("engine process died: exit code 3")
    assert m.candidate_id == Candidate.make(code_modules=[EXIT_AT_LOAD]).id
    m = await pool.measure(work(Candidate()))
    assert m.status == "ok", m.error
    assert pool.engines()[0].restarts == before + 1


async def test_a_candidate_past_its_deadline_times_out_and_the_engine_restarts(
    pool: EnginePool,
) -> None:
    before = pool.engines()[0].restarts
    slow = Candidate.make({"attention": "sleepy"}, code_modules=[SLEEPY_ATTENTION])
    m = await pool.measure(work(slow, deadline_s=1.0))
    assert m.status == "timed_out"
    assert "deadline of 1 s" in m.error
    m = await pool.measure(work(Candidate.make({"mlp": "fused_gate_up"})))
    assert m.status == "ok", m.error
    assert pool.engines()[0].restarts == before + 1


async def test_another_spec_evicts_the_least_recently_used_engine(pool: EnginePool) -> None:
    (old,) = pool.engines()
    m = await pool.measure(work(Candidate(), tier="full"))
    assert m.status == "ok" and m.tier == "full"
    (new,) = pool.engines()
    assert new.engine_id != old.engine_id and new.tier == "full"


async def test_unbuildable_workload_is_invalid_argument_without_evicting(pool: EnginePool) -> None:
    (held,) = pool.engines()
    bad = tiny_workload()
    bad["model"]["config_json"] = '{"model_type": "gpt2"}'
    with pytest.raises(InvalidArgument, match="unsupported architecture 'gpt2'"):
        await pool.measure(work(Candidate(), workload=bad))
    assert [e.engine_id for e in pool.engines()] == [held.engine_id]
