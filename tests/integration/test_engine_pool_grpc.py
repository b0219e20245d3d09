"""The engine pool service over real gRPC: RunExperiment on a real engine process (a candidate,
and a baseline through the measure injected as ``kiln serve`` does), ListEngines, and
INVALID_ARGUMENT for workloads no engine can be built for."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.protobuf.json_format import ParseDict

from kiln.baselines.in_engine import measure_baseline
from kiln.common.client import team_channel
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.domain.step_time import decision_step_ms
from kiln.engine_pool.app import EnginePoolApp
from kiln.engine_pool.service import NOTES_METADATA_KEY
from kiln.v1 import common_pb2, engine_pool_pb2, engine_pool_pb2_grpc

from ..pki import service_tls
from ..unit.engine_testing import TINY_LLAMA, ZEROS_ATTENTION, engine_settings, tiny_workload
from ..unit.runtime_app import free_port

pytestmark = pytest.mark.integration

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"


@pytest_asyncio.fixture(scope="module")
async def stub(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[engine_pool_pb2_grpc.EnginePoolStub]:
    settings = KilnSettings(
        metrics_port=0, grace_period_s=1.0, state_dir=tmp_path_factory.mktemp("engine-pool")
    )
    app = EnginePoolApp(settings, engine_settings(max_batch=4), external_measure=measure_baseline)
    addr, started = f"127.0.0.1:{free_port()}", asyncio.Event()
    task = asyncio.create_task(
        serve(app, settings, listen=addr, started=started, handle_signals=False)
    )
    await asyncio.wait_for(started.wait(), 10)
    # RunExperiment is for services and operators (kiln.common.policy): the agent runner's
    async with team_channel(addr, "search", tls=service_tls("agent-runner")) as ch:
        yield engine_pool_pb2_grpc.EnginePoolStub(ch)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _request(
    candidate: Candidate | common_pb2.Candidate = REFERENCE_CANDIDATE,
    workload: dict[str, object] | None = None,
    **kw: object,
) -> engine_pool_pb2.RunExperimentRequest:
    experiment = common_pb2.Experiment(
        experiment_id="exp-grpc",
        candidate=candidate.to_proto() if isinstance(candidate, Candidate) else candidate,
        tier=common_pb2.TIER_FAST,
        agent="test",
        workload=ParseDict(workload or tiny_workload(batch=12), common_pb2.Workload()),
    )
    return engine_pool_pb2.RunExperimentRequest(experiment=experiment, **kw)  # type: ignore[arg-type]


async def test_run_experiment_measures_on_an_engine(
    stub: engine_pool_pb2_grpc.EnginePoolStub,
) -> None:
    call = stub.RunExperiment(_request(Candidate.make({"attention": "sdpa"})), timeout=120)
    m = await call
    assert m.status == common_pb2.EXPERIMENT_STATUS_OK, m.error
    assert m.correct and m.tier == common_pb2.TIER_FAST and m.engine_id
    assert len(m.timing.samples_ms) == 3 and m.timing.median_ms > 0
    t = m.timing  # tokens/s per decision step: the median unless the mean is 1.25x above it
    assert t.mean_ms > 0 and t.max_ms == max(t.samples_ms)
    step = decision_step_ms(t.median_ms, t.mean_ms)
    assert m.tokens_per_s == pytest.approx(4 / (step / 1e3))  # batch clamped to 4
    assert m.verified_steps == 3 and m.escape_probability == pytest.approx(0.8**3)
    assert m.batch_size == 4 and m.context_len > 0  # the operating point measured at
    assert m.memory.weights_bytes > 0 and m.memory.kv_cache_bytes > 0
    trailing = dict(await call.trailing_metadata())  # type: ignore[arg-type]
    notes = json.loads(trailing[NOTES_METADATA_KEY])
    assert any("batch clamped from 12 to 4" in n for n in notes)


async def test_a_failing_candidate_is_a_measurement_not_an_error(
    stub: engine_pool_pb2_grpc.EnginePoolStub,
) -> None:
    zeros = Candidate.make({"attention": "zeros"}, code_modules=[ZEROS_ATTENTION])
    m = await stub.RunExperiment(_request(zeros), timeout=120)
    assert m.status == common_pb2.EXPERIMENT_STATUS_INCORRECT and not m.correct
    assert m.max_abs_error > 0 and "incorrect" in m.error


async def test_list_engines(stub: engine_pool_pb2_grpc.EnginePoolStub) -> None:
    await stub.RunExperiment(_request(), timeout=120)
    (engine,) = (await stub.ListEngines(engine_pool_pb2.ListEnginesRequest())).engines
    assert engine.state == engine_pool_pb2.ENGINE_STATE_READY
    assert engine.model_name == "tiny-llama" and engine.tier == common_pb2.TIER_FAST
    assert engine.device == "cpu" and engine.host
    assert engine.experiments_run >= 1 and engine.cold_start_s > 0
    assert engine.memory.weights_bytes > 0 and engine.started_at.seconds > 0
    assert engine.pool_id and engine.engine_id.endswith(f"/cpu@{engine.pool_id}")
    assert len(engine.spec_key) == 24 and len(engine.model_key) == 12
    assert engine.device_kind == "cpu" and engine.pid > 0 and engine.restarts == 0
    assert engine.last_heartbeat.seconds > 0 and engine.notes
    # No NATS here: the registry is this pool alone.
    (pool,) = (await stub.ListEngines(engine_pool_pb2.ListEnginesRequest())).pools
    assert pool.local and pool.pool_id == engine.pool_id and pool.pid > 0
    assert [(d.device, d.kind) for d in pool.devices] == [("cpu", "cpu")]
    assert pool.experiments_done >= 1 and pool.hardware == []  # gRPC only: takes no queued work
    other = await stub.ListEngines(engine_pool_pb2.ListEnginesRequest(model_name="other"))
    assert list(other.engines) == [] and len(other.pools) == 1


def _without_config() -> dict[str, object]:
    workload = tiny_workload()
    workload["model"] = {"name": "nothing"}
    return workload


def _config(raw: dict[str, object]) -> dict[str, object]:
    workload = tiny_workload()
    workload["model"]["config_json"] = json.dumps(raw)
    return workload


def _experiment(**fields: object) -> engine_pool_pb2.RunExperimentRequest:
    request = _request()
    for name, value in fields.items():
        setattr(request.experiment, name, value)
    return request


_TWICE_COMPILED = common_pb2.Candidate(
    transforms=[common_pb2.Transform(name="torch_compile")] * 2  # one transform, named twice
)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (engine_pool_pb2.RunExperimentRequest(), "experiment is missing"),
        (_request(workload=_without_config()), "config_json is empty"),
        (_request(workload=_config({"model_type": "gpt2"})), "unsupported architecture 'gpt2'"),
        (_request(workload=_config({**TINY_LLAMA, "hidden_act": "gelu"})), "activation 'gelu'"),
        (_request(deadline_s=4000.0), "deadline_s 4000.0 is outside"),
        (_request(_TWICE_COMPILED), 'malformed candidate: ValueError("a transform appears twice'),
        (_experiment(tier=999), "experiment.tier 999 is unknown"),
        (_experiment(experiment_id="a\x00b"), "experiment.experiment_id"),
        (_experiment(compilation_id="c" * 200), "experiment.compilation_id"),
    ],
)
async def test_bad_requests_are_invalid_argument(
    stub: engine_pool_pb2_grpc.EnginePoolStub,
    request_: engine_pool_pb2.RunExperimentRequest,
    message: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RunExperiment(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (err.value.details() or "")


@pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is not here")
async def test_unbuildable_models_are_invalid_argument(
    stub: engine_pool_pb2_grpc.EnginePoolStub,
) -> None:
    workload = tiny_workload()
    raw = json.loads((MODELS / "deepseek-v3.json").read_text())
    workload["model"] = {  # DeepSeek-V3 builds; its greedy-router relatives do not yet
        "name": "deepseek-v3",
        "config_json": json.dumps({**raw, "topk_method": "greedy"}),
    }
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RunExperiment(_request(workload=workload), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top-k method 'greedy'" in (err.value.details() or "")


async def test_a_baseline_is_measured_in_the_engine_process(
    stub: engine_pool_pb2_grpc.EnginePoolStub,
) -> None:
    call = stub.RunExperiment(_request(baseline="hf_eager"), timeout=300)
    m = await call
    assert m.status == common_pb2.EXPERIMENT_STATUS_OK and m.correct, m.error
    assert m.tokens_per_s > 0 and m.batch_size == 4
    trailing = dict(await call.trailing_metadata())  # type: ignore[arg-type]
    assert "baseline hf_eager" in json.loads(trailing[NOTES_METADATA_KEY])
