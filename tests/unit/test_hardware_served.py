"""Which hardware an engine pool takes work for (a device never takes another kind's), and what
Submit makes of the registry (kiln.agent_runner.pools.check_served)."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.agent_runner.pools import check_served
from kiln.common.errors import FailedPrecondition
from kiln.common.settings import KilnSettings
from kiln.common.work import ExperimentWork, model_key
from kiln.domain.candidate import Candidate
from kiln.engine_pool.devices import CPU, Device
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.queue import WorkConsumer
from kiln.engine_pool.settings import EngineSettings
from kiln.v1 import engine_pool_pb2

H200 = Device("cuda:0", "h200", "NVIDIA H200", "GPU-a")


def _consumer(devices: list[Device], hardware: str = "") -> WorkConsumer:
    settings = EngineSettings(consume=False, hardware=hardware)
    pool = EnginePool(settings, pool_id="t", devices=devices)
    return WorkConsumer(KilnSettings(), pool.settings, pool)


@pytest.mark.parametrize("hardware", ["", "*", "cpu", "cpu,h100"])
def test_a_cpu_pool_takes_cpu_work_only(hardware: str) -> None:
    c = _consumer([CPU], hardware)
    assert c.hardware == ["cpu"]
    assert c.serves("cpu", "m") and not c.serves("h100", "m")
    assert c.kinds_for(c.pool.slots["cpu"]) == ["cpu"]


def test_hardware_narrows_a_mixed_pool_and_never_widens_it() -> None:
    c = _consumer([CPU, H200], "h200")
    assert c.hardware == ["h200"] and c.kinds_for(c.pool.slots["cpu"]) == []
    assert _consumer([CPU, H200], "*").hardware == ["cpu", "h200"]
    assert _consumer([CPU], "h100").hardware == []  # a kind no device has is ignored


def test_run_experiment_picks_a_device_of_the_workloads_kind() -> None:
    pool = EnginePool(EngineSettings(consume=False), pool_id="t", devices=[CPU, H200])
    work = ExperimentWork(
        experiment_id="e",
        compilation_id="c",
        team="t",
        tier="fast",
        candidate=Candidate().canonical(),
        workload={"hardware": {"name": "h200"}, "model": {"config_json": "{}"}},
        deadline_s=10,
    )
    assert pool.choose_slot(work, "h200").device is H200
    assert pool.choose_slot(work, "cpu").device is CPU
    with pytest.raises(FailedPrecondition, match="no 'h100' device"):
        pool.choose_slot(work, "h100")


WORKLOAD: dict[str, Any] = {"model": {"config_json": "{}"}, "hardware": {"name": "h100"}}


def _pool(pool_id: str, kinds: list[str], hardware: list[str], **kw: Any) -> Any:
    return engine_pool_pb2.PoolInfo(
        pool_id=pool_id,
        host="h",
        devices=[engine_pool_pb2.DeviceInfo(device=f"d{i}", kind=k) for i, k in enumerate(kinds)],
        hardware=hardware,
        **kw,
    )


def test_no_pool_of_the_kind_is_refused_naming_what_the_pools_serve() -> None:
    with pytest.raises(FailedPrecondition) as err:
        check_served([_pool("cpu-1", ["cpu"], ["cpu"])], WORKLOAD, 0)
    assert "no engine pool serves hardware 'h100'" in err.value.message
    assert "serve cpu (pool cpu-1 on h: 1 cpu device, takes cpu)" in err.value.message
    with pytest.raises(FailedPrecondition, match="take no queued work"):
        check_served([_pool("rpc-only", ["h100"], [])], WORKLOAD, 0)  # KILN_ENGINE_CONSUME off
    with pytest.raises(FailedPrecondition, match="none registered"):
        check_served([], WORKLOAD, 0)


def test_a_pool_of_the_kind_or_an_older_any_pool_serves() -> None:
    assert check_served([_pool("g", ["h100"] * 8, ["h100"])], WORKLOAD, 8) == []
    assert check_served([_pool("old", ["cpu"], ["*"])], WORKLOAD, 0) == []


def test_a_pool_limited_to_other_models_does_not_serve() -> None:
    other = _pool("g", ["h100"], ["h100"], models=["000000000000"])
    with pytest.raises(FailedPrecondition, match="takes this model"):
        check_served([other], WORKLOAD, 0)
    mine = _pool("g", ["h100"], ["h100"], models=[model_key(WORKLOAD)])
    assert check_served([mine], WORKLOAD, 0) == []


def test_more_devices_than_the_pools_have_is_a_note() -> None:
    (note,) = check_served([_pool("cpu-1", ["cpu"], ["cpu"])], {"hardware": {"name": "cpu"}}, 4)
    assert note.startswith("workload.hardware.num_devices is 4, but the engine pools serving cpu")
    assert "have 1 cpu device:" in note
    assert check_served([_pool("cpu-1", ["cpu"], ["cpu"])], {"hardware": {"name": "cpu"}}, 1) == []


async def test_no_engine_pool_answering_is_a_note_not_a_refusal() -> None:
    from kiln.agent_runner.pools import EnginePools

    pools = EnginePools("127.0.0.1:1", "t", timeout_s=5.0)  # nothing listens there
    try:
        (note,) = await pools.check(WORKLOAD, 0)
    finally:
        await pools.close()
    assert note.startswith("no engine pool answered at 127.0.0.1:1, so whether one serves")
    assert "the compilation waits for a pool of that kind" in note
