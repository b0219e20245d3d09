"""Isolation through a real engine process, for what ``test_engine_isolation`` does not cover
(it has a candidate that exits at load, segfaults at load, raises, sleeps past its deadline, and
a SIGKILL sent from outside): a candidate that kills its own process with SIGKILL from inside
its forward in the middle of the timed steps, and a red-team cheat whose measurement asks for a
restart (the process is replaced). After each, the same engine measures the reference."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio

from kiln.domain.candidate import Candidate
from kiln.engine_pool.process import EngineProcess
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from tests.red_team import cheats as red_team

from .engine_testing import module, tiny_workload

LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=1)

# Kills its own process from inside the forward, on the third decode step at the traffic shape
# (the first is checked, the second is the first timed step): mid-measurement, not at load.
SIGKILL_IN_FORWARD = module(
    "sigkill",
    """
import signal

_calls = []

@register("lm_head", "sigkill", replace=True)
def sigkill(x, *, weight):
    if x.shape[0] == 3:
        _calls.append(1)
        if len(_calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
    return (x @ weight.T).float()
""",
)


@pytest_asyncio.fixture(scope="module")
async def engine() -> AsyncIterator[EngineProcess]:
    spec = EngineSpec.from_workload(tiny_workload(batch=3, context=24), "fast", LIMITS)
    process = EngineProcess(spec, "red-team-isolation", ready_timeout_s=300)
    process.start()
    try:
        await process.wait_ready()
        yield process
    finally:
        await process.stop()


async def _run(engine: EngineProcess, candidate: Candidate) -> Measurement:
    request = RunRequest("iso", candidate, warmup=1, repeats=4, min_repeats=4)
    return await engine.run(request, deadline_s=60)


async def test_a_candidate_that_sigkills_itself_mid_measurement(engine: EngineProcess) -> None:
    before = engine.restarts
    m = await _run(
        engine, Candidate.make({"lm_head": "sigkill"}, code_modules=[SIGKILL_IN_FORWARD])
    )
    assert m.status == "crashed"
    assert "candidate sandbox died: killed by signal SIGKILL" in m.error
    ok = await _run(engine, Candidate())
    assert ok.status == "ok", ok.error
    assert engine.restarts == before  # the sandbox restarted, not the engine


async def test_a_cheat_through_the_process_is_incorrect_and_restarts_it(
    engine: EngineProcess,
) -> None:
    before = engine.restarts
    (cheat,) = [c for c in red_team.CHEATS if c.name == "shared_class_patch"]
    m = await _run(engine, cheat.candidate)
    assert m.status == "incorrect" and red_team.JUDGED in m.error
    ok = await _run(engine, Candidate())
    assert ok.status == "ok", ok.error
    assert engine.restarts == before  # the sandbox replaced, not the engine
