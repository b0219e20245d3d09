"""An engine whose weights cannot be shared with a sandbox (on CUDA: the device has no room
for their exported copy, or the driver refuses the export, on the first code-module candidate)
rejects code-module candidates with the reason and
never runs them in its own process; recipes still run. The CUDA export cannot run here, so the
failure is injected by replacing ``SharedWeights`` on a CPU engine (said so)."""

from __future__ import annotations

import pytest

from kiln.domain.candidate import Candidate
from kiln.runtime import engine_sandbox
from kiln.runtime.engine import Engine
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec

from .engine_testing import HANDWRITTEN_MLP, tiny_workload

LIMITS = EngineLimits(max_batch=3, max_context=40, prompt_len=8, check_steps=2, check_batch=2)


def test_code_modules_are_rejected_when_no_sandbox_can_hold_the_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = EngineSpec.from_workload(tiny_workload(), "fast", LIMITS)
    engine = Engine(spec, engine_id="share-failure")
    try:
        engine._shared = None  # as a CUDA engine before its first code-module candidate

        def refuse(store: object) -> None:
            raise RuntimeError("cuMemCreate failed: CUDA driver error 2 (out of memory)")

        monkeypatch.setattr(engine_sandbox, "SharedWeights", refuse)
        code = Candidate.make({"mlp": "handwritten"}, code_modules=[HANDWRITTEN_MLP])
        m = engine.run(RunRequest("c1", code, warmup=1, repeats=2, seed=1))
        assert m.status == "rejected", m.error
        assert "code modules run only in a sandbox" in m.error
        assert "cuMemCreate failed" in m.error
        again = engine.run(RunRequest("c2", code, warmup=1, repeats=2, seed=2))
        assert again.status == "rejected"  # remembered, not retried per candidate
        recipe = engine.run(
            RunRequest("r", Candidate.make({"attention": "sdpa"}), warmup=1, repeats=2, seed=3)
        )
        assert recipe.status == "ok", recipe.error
    finally:
        engine.close()
