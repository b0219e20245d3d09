"""The per-op profile on a CUDA engine (skipped without CUDA): CUDA events around each op of
one eager decode step, also under a CUDA graph (set aside for the profiled step), and the timed
steps unchanged by it.

Run on a GPU host: ``pytest --noconftest tests/gpu/test_op_profile_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, Transform
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineSpec
from tests.unit.engine_testing import tiny_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    settings = EngineSettings(device="cuda:0")
    spec = EngineSpec.from_workload(
        tiny_workload(batch=4, context=64, dtype="bfloat16"), "fast", settings.limits()
    )
    return Engine(spec, engine_id="gpu-profile")


def _run(engine: Engine, candidate: Candidate, profile: bool) -> Measurement:
    return engine.run(
        RunRequest("gpu", candidate, warmup=2, repeats=30, min_repeats=10, profile=profile)
    )


def test_cuda_profile_per_op(engine: Engine) -> None:
    m = _run(engine, REFERENCE_CANDIDATE, profile=True)
    assert m.status == "ok", m.error
    assert {"attention", "mlp", "qkv_proj", "lm_head"} <= set(m.op_ms)
    assert all(ms > 0 for ms in m.op_ms.values())
    assert m.op_profile_shape["dtype_bytes"] == 2 and m.op_profile_shape["batch_size"] == 4


def test_cuda_graph_candidate_is_profiled_eagerly_and_kept_graphed(engine: Engine) -> None:
    graphed = Candidate.make({}, [Transform.of("cuda_graph")])
    m = _run(engine, graphed, profile=True)
    assert m.status == "ok", m.error
    assert set(m.op_ms) >= {"attention", "mlp"}  # eager: every op seen, not one graph replay
    plain = _run(engine, graphed, profile=False)
    assert m.timing is not None and plain.timing is not None
    # the profile runs after timing: the medians agree within noise
    assert m.timing.median_ms == pytest.approx(plain.timing.median_ms, rel=0.5)
