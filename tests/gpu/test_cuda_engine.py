"""CUDA engines (skipped without CUDA): bf16 weights on the device, CUDA-graph candidates,
measured memory, and isolation of a candidate that breaks the CUDA context.

Run on a GPU host: ``pytest --noconftest tests/gpu`` (the suite's conftest needs the services'
dependencies; these tests need only torch and the engine).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kiln.domain.candidate import Candidate, Transform
from kiln.engine_pool.process import EngineProcess
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.device_fault import SANDBOX_FAULT
from kiln.runtime.engine import Engine
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineSpec
from tests.unit.engine_testing import module, tiny_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

GRAPH = [Transform.of("cuda_graph")]


def _spec(batch: int = 4, context: int = 64, dtype: str = "bfloat16") -> EngineSpec:
    settings = EngineSettings(device="cuda:0")
    return EngineSpec.from_workload(
        tiny_workload(batch=batch, context=context, dtype=dtype), "fast", settings.limits()
    )


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(_spec(), engine_id="gpu-test")


def _run(engine: Engine, candidate: Candidate) -> object:
    return engine.run(RunRequest("gpu", candidate, warmup=2, repeats=30, min_repeats=10))


def test_reference_on_cuda_is_bf16_and_measured(engine: Engine) -> None:
    assert next(iter(engine.weights.items()))[1].is_cuda
    m = _run(engine, Candidate())
    assert m.status == "ok" and m.correct, m.error
    assert m.timing is not None and m.timing.median_ms > 0
    assert m.memory.workspace_bytes > 0  # measured peak, not an estimate


@pytest.mark.parametrize(
    "ops",
    [{}, {"attention": "sdpa", "qkv_proj": "fused", "mlp": "fused_gate_up"}],
)
def test_cuda_graph_candidates_are_correct_and_timed(engine: Engine, ops: dict[str, str]) -> None:
    m = _run(engine, Candidate.make(ops, transforms=GRAPH))
    assert m.status == "ok" and m.correct, m.error
    assert m.phases_ms.get("graph_capture", 0) > 0
    # after the experiment the engine is back on the eager reference
    assert "decode_step" not in engine.model.__dict__
    again = _run(engine, Candidate())
    assert again.status == "ok"


def test_a_graph_of_a_wrong_candidate_is_rejected(engine: Engine) -> None:
    wrong = module(
        "gpu_wrong",
        """
@register("lm_head", "gpu_wrong", replace=True)
def gpu_wrong(x, *, weight):
    return (torch.nn.functional.linear(x, weight) * 1.5).float()
""",
    )
    m = _run(
        engine, Candidate.make({"lm_head": "gpu_wrong"}, code_modules=[wrong], transforms=GRAPH)
    )
    assert m.status == "incorrect", m.error


def test_kv_cache_is_sized_from_free_memory() -> None:
    spec = _spec(batch=8, context=64)
    free = torch.cuda.mem_get_info()[0]
    huge = dataclasses.replace(spec, batch_size=10**9)
    from kiln.runtime.device_memory import fit_batch

    fitted = fit_batch(huge, spec.model_config(), free)
    assert 1 <= fitted.batch_size < 10**9
    assert any("batch lowered" in note for note in fitted.notes)


def test_a_device_side_assert_in_the_sandbox_replaces_the_sandbox_not_the_engine() -> None:
    bad = module(
        "gpu_oob",
        """
@register("embedding", "gpu_oob", replace=True)
def gpu_oob(tokens, *, weight):
    return weight[tokens + 10**9]  # out-of-range gather: a device-side assert
""",
    )

    async def scenario() -> tuple[str, str, str]:
        proc = EngineProcess(_spec(batch=2, context=32), "gpu-crash", ready_timeout_s=600)
        proc.start()
        try:
            await proc.wait_ready()
            cand = Candidate.make({"embedding": "gpu_oob"}, code_modules=[bad])
            req = RunRequest("oob", cand, warmup=1, repeats=5)
            m = await proc.run(req, deadline_s=120)
            ok = await proc.run(
                RunRequest("after", Candidate(), warmup=1, repeats=5),
                deadline_s=300,
            )
            return m.status, m.error, ok.status
        finally:
            await proc.stop()

    status, error, after = asyncio.run(scenario())
    assert status == "crashed", error
    assert error.startswith(SANDBOX_FAULT), error  # the judge's context is intact
    assert after == "ok"
