"""What one sandboxed candidate leaves behind never reaches the next one (docs/design/engine.md,
"Sandbox", "Lifecycle"), whatever its outcome: a code module that replaces
``torch.nn.functional.linear`` with a wrong one and then raises while loading, or is refused at
bind, is put back and checked like one that loads, and its sandbox is replaced. The next,
honest candidate checks at load that ``F.linear`` is torch's own and uses it in its MLP. The
engine here is the real one (in this process, the judge) with its real sandbox process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kiln.domain.candidate import Candidate
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec

from .engine_testing import module, tiny_workload

LIMITS = EngineLimits(max_batch=3, max_context=40, prompt_len=8, check_steps=1, check_batch=2)

# the red team's sabotage: a slow, slightly wrong F.linear for whoever comes next
PATCH = """
import torch.nn.functional as F

_real = F.linear

def _slow_linear(x, w, b=None):
    time.sleep(0.002)
    return _real(x, w, b) * 1.001

F.linear = _slow_linear
"""
RAISES_AT_LOAD = module("saboteur_raises", PATCH + "raise RuntimeError('oops, failed to load')\n")
REFUSED_AT_BIND = module("saboteur_refused", PATCH)

# the next team's honest candidate: its MLP goes through F.linear, which it checks first
HONEST = module(
    "honest_linear_mlp",
    """
import torch.nn.functional as F

if F.linear is not torch._C._nn.linear:
    raise RuntimeError(f"residue: F.linear is {F.linear!r}")

@register("mlp", "linear_mlp", replace=True)
def linear_mlp(x, *, gate_weight, up_weight, down_weight):
    gate = F.linear(x, gate_weight)
    return F.linear((gate * torch.sigmoid(gate)) * F.linear(x, up_weight), down_weight)
""",
)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    spec = EngineSpec.from_workload(tiny_workload(), "fast", LIMITS)
    e = Engine(spec, engine_id="sandbox-residue")
    try:
        yield e
    finally:
        e.close()


def _run(engine: Engine, candidate: Candidate) -> Measurement:
    m = engine.run(RunRequest("residue", candidate, warmup=1, repeats=2, seed=3))
    engine.after_reply()  # what the worker does once the result is sent
    return m


@pytest.mark.parametrize(
    ("saboteur", "status"),
    [
        (Candidate.make(code_modules=[RAISES_AT_LOAD]), "crashed"),
        (Candidate.make({"mlp": "no_such_mlp"}, code_modules=[REFUSED_AT_BIND]), "rejected"),
    ],
    ids=["raises_at_load", "refused_at_bind"],
)
def test_a_failed_candidates_residue_never_reaches_the_next_one(
    engine: Engine, saboteur: Candidate, status: str
) -> None:
    honest = Candidate.make({"mlp": "linear_mlp"}, code_modules=[HONEST])
    assert _run(engine, honest).status == "ok"  # a sandbox that has run a candidate
    host = engine._sandbox
    assert host is not None
    pid, replaced = host.pid, len(host.replaced)
    m = _run(engine, saboteur)
    assert m.status == status, m.error
    # put back and checked: the patched F.linear is seen and the sandbox replaced
    assert len(host.replaced) == replaced + 1
    assert "torch.nn.functional" in host.replaced[-1] and "linear" in host.replaced[-1]
    assert host.pid not in (0, pid)
    m = _run(engine, honest)
    assert m.status == "ok", m.error  # its load would raise on the residue
