"""Engines as real processes: a candidate that kills its process (exit, segfault, SIGKILL from
outside), never returns, or hits a device fault fails its experiment with that cause, and the
engine comes back for the next one; one device's crash leaves the other devices alone."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kiln.common.errors import InvalidArgument
from kiln.domain.candidate import Candidate
from kiln.engine_pool.devices import Device
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.process import is_device_fault
from kiln.runtime.device_fault import SANDBOX_FAULT

from .engine_testing import (
    EXIT_AT_LOAD,
    RAISING_MLP,
    SLEEPY_ATTENTION,
    engine_settings,
    job,
    module,
    tiny_workload,
    work,
)


@pytest_asyncio.fixture(scope="module")
async def pool() -> AsyncIterator[EnginePool]:
    p = EnginePool(engine_settings(max_engines=1), host="test-host")
    try:
        yield p
    finally:
        await p.close()


async def test_first_experiment_builds_the_engine_in_a_clean_process(pool: EnginePool) -> None:
    m = await pool.measure(job(Candidate.make({"attention": "sdpa"})))
    assert m.status == "ok", m.error
    (engine,) = pool.engines()
    assert engine.state == "ready" and engine.experiments_run == 1
    assert engine.cold_start_s > 0 and engine.memory.weights_bytes > 0
    assert engine.engine_id == m.engine_id
    assert engine.engine_id.endswith(f"/{engine.device}@{pool.pool_id}")  # cuda:0 on a GPU host
    assert pool.pool_id.startswith("test-host-")
    (process,) = pool.processes()
    assert process.info["service_modules"] == []  # no grpc, nats, sqlalchemy in the engine


async def test_a_candidate_that_exits_crashes_and_the_engine_restarts(pool: EnginePool) -> None:
    before = pool.engines()[0].restarts
    m = await pool.measure(job(Candidate.make(code_modules=[EXIT_AT_LOAD])))
    assert m.status == "crashed"
    assert "candidate sandbox died: exit code 3" in m.error  # the sandbox, not the engine
    assert m.candidate_id == Candidate.make(code_modules=[EXIT_AT_LOAD]).id
    m = await pool.measure(job(Candidate()))
    assert m.status == "ok", m.error
    assert pool.engines()[0].restarts == before  # the sandbox restarted, not the engine


async def test_a_candidate_past_its_deadline_times_out_and_the_engine_restarts(
    pool: EnginePool,
) -> None:
    before = pool.engines()[0].restarts
    slow = Candidate.make({"attention": "sleepy"}, code_modules=[SLEEPY_ATTENTION])
    m = await pool.measure(job(slow, deadline_s=1.0))
    assert m.status == "timed_out"
    assert "deadline of 1 s" in m.error
    m = await pool.measure(job(Candidate.make({"mlp": "fused_gate_up"})))
    assert m.status == "ok", m.error
    assert pool.engines()[0].restarts == before  # the sandbox restarted, not the engine


async def test_another_spec_evicts_the_least_recently_used_engine(pool: EnginePool) -> None:
    (old,) = pool.engines()
    m = await pool.measure(job(Candidate(), tier="full"))
    assert m.status == "ok" and m.tier == "full"
    (new,) = pool.engines()
    assert new.engine_id != old.engine_id and new.tier == "full"


async def test_unbuildable_workload_is_invalid_argument_without_evicting(pool: EnginePool) -> None:
    (held,) = pool.engines()
    bad = tiny_workload()
    bad["model"]["config_json"] = '{"model_type": "gpt2"}'
    with pytest.raises(InvalidArgument, match="unsupported architecture 'gpt2'"):
        await pool.measure(job(Candidate(), workload=bad))
    assert [e.engine_id for e in pool.engines()] == [held.engine_id]


SEGFAULT_AT_LOAD = module("segv", "import ctypes\nctypes.string_at(0)\n")

CUDA_FAULT_MLP = module(
    "cuda_fault",
    """
@register("mlp", "cuda_fault", replace=True)
def cuda_fault(x, *, gate_weight, up_weight, down_weight):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
""",
)


async def test_a_candidate_that_segfaults_crashes_with_the_signal(pool: EnginePool) -> None:
    await pool.warm(work(Candidate()))  # the fast engine again (the test before built full)
    before = pool.engines()[0].restarts
    m = await pool.measure(job(Candidate.make(code_modules=[SEGFAULT_AT_LOAD])))
    assert m.status == "crashed"
    assert "killed by signal SIGSEGV" in m.error and "sandbox restarted" in m.error
    m = await pool.measure(job(Candidate()))
    assert m.status == "ok", m.error
    assert pool.engines()[0].restarts == before  # the sandbox restarted, not the engine


async def test_an_engine_killed_mid_experiment_crashes_it_and_comes_back(pool: EnginePool) -> None:
    (engine,) = pool.processes()
    before = engine.restarts
    slow = Candidate.make({"attention": "sleepy"}, code_modules=[SLEEPY_ATTENTION])
    running = asyncio.create_task(pool.measure(job(slow, deadline_s=60.0)))
    for _ in range(200):  # until the experiment is on the engine
        if engine.state == "busy":
            break
        await asyncio.sleep(0.05)
    assert engine.state == "busy"
    pid = engine.pid
    await asyncio.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    m = await asyncio.wait_for(running, 30)
    assert m.status == "crashed" and "killed by signal SIGKILL" in m.error
    m = await pool.measure(job(Candidate()))
    assert m.status == "ok", m.error
    assert engine.restarts == before + 1 and engine.pid not in (0, pid)


async def test_a_raising_candidate_crashes_without_a_restart(pool: EnginePool) -> None:
    before = pool.engines()[0].restarts
    m = await pool.measure(job(Candidate.make({"mlp": "boom"}, code_modules=[RAISING_MLP])))
    assert m.status == "crashed" and "kaboom from a candidate" in m.error
    assert pool.engines()[0].restarts == before
    m = await pool.measure(job(Candidate()))
    assert m.status == "ok", m.error


async def test_a_device_fault_in_the_sandbox_replaces_the_sandbox_not_the_engine(
    pool: EnginePool,
) -> None:
    """The sandbox's CUDA context is its own: the judge's stays usable, so only the sandbox
    goes (a fault in the judge's own process restarts the engine: is_device_fault below)."""
    before = pool.engines()[0].restarts
    cand = Candidate.make({"mlp": "cuda_fault"}, code_modules=[CUDA_FAULT_MLP])
    m = await pool.measure(job(cand))
    assert m.status == "crashed" and "CUDA error" in m.error
    assert m.error.startswith(SANDBOX_FAULT)
    assert "device fault in the candidate's sandbox: sandbox replaced" in m.notes
    assert "device fault: engine restarted" not in m.notes
    assert pool.engines()[0].restarts == before
    m = await pool.measure(job(Candidate()))
    assert m.status == "ok", m.error


async def test_a_crash_loses_no_other_experiment_queued_on_the_device(pool: EnginePool) -> None:
    before = pool.engines()[0].restarts
    crash, good, also_good = await asyncio.gather(
        pool.measure(job(Candidate.make(code_modules=[EXIT_AT_LOAD]))),
        pool.measure(job(Candidate.make({"attention": "sdpa"}))),
        pool.measure(job(Candidate())),
    )
    assert crash.status == "crashed"
    assert good.status == "ok" and also_good.status == "ok", (good.error, also_good.error)
    assert pool.engines()[0].restarts == before  # the sandbox restarted, not the engine


def test_device_faults_are_recognised() -> None:
    assert is_device_fault("bind: RuntimeError: CUDA error: device-side assert triggered")
    assert is_device_fault("measure: torch.AcceleratorError: CUDA error: unspecified launch")
    assert not is_device_fault("check: RuntimeError: kaboom from a candidate")
    assert not is_device_fault(f"{SANDBOX_FAULT}: check: RuntimeError: CUDA error: an illegal")


async def test_devices_are_separate_engine_processes_that_fail_alone() -> None:
    devices = [Device("cpu:0", "cpu"), Device("cpu:1", "cpu")]
    p = EnginePool(engine_settings(), host="two-devices", devices=devices)
    try:
        crash, good = await asyncio.gather(
            p.measure(job(Candidate.make(code_modules=[EXIT_AT_LOAD])), device="cpu:0"),
            p.measure(job(Candidate()), device="cpu:1"),
        )
        assert crash.status == "crashed" and good.status == "ok", good.error
        assert crash.engine_id.endswith(f"/cpu:0@{p.pool_id}")
        assert good.engine_id.endswith(f"/cpu:1@{p.pool_id}")
        first, second = p.processes()
        assert first.pid and second.pid and first.pid != second.pid
        assert (first.restarts, second.restarts) == (
            0,
            0,
        )  # each device's sandbox restarted, no engine
        # no GPU for CPU engines; threads as the settings say
        assert (
            first.env == second.env == {"CUDA_VISIBLE_DEVICES": "", "KILN_ENGINE_THREADS": "auto"}
        )
        # RunExperiment's choice: an idle device already holding the model.
        assert p.choose_slot(work(Candidate())).device.name == "cpu:0"
        assert p.resident("cpu:1") == [("fast", work(Candidate()).model_key)]
        with pytest.raises(InvalidArgument, match="not one of this pool's"):
            await p.measure(job(Candidate()), device="cuda:7")
    finally:
        await p.close()
