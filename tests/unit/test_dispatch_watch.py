"""The dispatcher watch: a kernel registered for an ``aten`` op is named (and its library
destroyed on restore); on a sandboxed engine, where only recipes (library code) run in the
judge's process, the watch runs after the reply and a change there restarts the engine; an
engine that runs code modules in its own process still checks within the experiment."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from kiln.domain.candidate import Candidate
from kiln.ops.registry import register, unregister
from kiln.runtime.dispatch_watch import DispatchTables
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec

from .engine_testing import TINY_LLAMA, tiny_workload

LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)
_LEAKED: list[torch.library.Library] = []
_ARMED: list[bool] = []
"""Non-empty: the next call leaks (the engine warms every built-in implementation at build)."""


def leaks_a_kernel(x: torch.Tensor, *, weight: torch.Tensor) -> torch.Tensor:
    """An honest LM head with a library bug: its first call registers a CPU kernel for
    ``aten::erfinv`` (an op the reference never calls), as a careless library might."""
    if _ARMED and not _LEAKED:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("erfinv", lambda t: t.clone(), "CPU")
        _LEAKED.append(lib)
    return torch.nn.functional.linear(x, weight).float()


@pytest.fixture(autouse=True)
def _no_leak_left() -> Iterator[None]:
    """``leaks_a_kernel`` registered for this test only (the registry is the process's: other
    tests on this worker count its implementations)."""
    register("lm_head", "leaks_a_kernel", replace=True)(leaks_a_kernel)
    try:
        yield
    finally:
        unregister("lm_head", "leaks_a_kernel")
        _ARMED.clear()
        while _LEAKED:
            _LEAKED.pop()._destroy()


def _engine(sandbox: bool) -> Engine:
    workload = tiny_workload(batch=2, context=16)
    workload["model"]["config_json"] = json.dumps(TINY_LLAMA)
    spec = EngineSpec.from_workload(workload, "fast", LIMITS)
    return Engine(spec, engine_id=f"dispatch-{sandbox}", sandbox=sandbox)


def _run(engine: Engine, candidate: Candidate) -> Measurement:
    return engine.run(RunRequest("dispatch", candidate, warmup=1, repeats=3))


def test_tables_name_a_registered_kernel_and_restore_destroys_it() -> None:
    tables = DispatchTables.take()
    assert tables.changes() == []
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("erfinv", lambda t: t.clone(), "CPU")
    (change,) = tables.changes()
    assert change.startswith("dispatcher kernel for aten::erfinv at CPU replaced")
    assert tables.restore() == []
    assert tables.changes() == []
    x = torch.full((3,), 0.5)
    assert not torch.equal(torch.erfinv(x), x)  # the real kernel again


def test_a_sandboxed_engine_checks_the_dispatcher_after_the_reply() -> None:
    engine = _engine(sandbox=True)
    assert _run(engine, Candidate()).status == "ok"
    assert engine.after_reply() == ""
    _ARMED.append(True)
    m = _run(engine, Candidate.make({"lm_head": "leaks_a_kernel"}))
    assert m.status == "ok", m.error
    problem = engine.after_reply()
    assert "a recipe changed dispatcher kernels" in problem and "aten::erfinv" in problem
    assert "still replaced" not in problem  # the leaked library was destroyed
    assert engine.after_reply() == ""  # checked once


def test_an_in_process_engine_checks_the_dispatcher_within_the_experiment() -> None:
    engine = _engine(sandbox=False)
    assert _run(engine, Candidate()).status == "ok"
    _ARMED.append(True)
    m = _run(engine, Candidate.make({"lm_head": "leaks_a_kernel"}))
    assert m.status == "incorrect" and "aten::erfinv" in m.error
    assert m.restart_engine
