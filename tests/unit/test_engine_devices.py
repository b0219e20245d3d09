"""Devices of an engine pool (one engine process each, pinned) and the work subjects they
serve: device lists, GPU kinds, CUDA_VISIBLE_DEVICES, model keys and subject names."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest

from kiln.common.errors import InvalidArgument
from kiln.common.nats import parse_work_subject, work_filter, work_subject
from kiln.common.work import device_kind, model_key
from kiln.domain.candidate import Candidate
from kiln.engine_pool import devices as devmod
from kiln.engine_pool.devices import CPU, DeviceError, Gpu, gpu_kind, resolve_devices
from kiln.engine_pool.process import _environ
from kiln.engine_pool.queue import durable_name
from kiln.engine_pool.settings import EngineSettings

from .engine_testing import tiny_workload, work

H200S = [Gpu(0, "GPU-aaaa", "NVIDIA H200"), Gpu(1, "GPU-bbbb", "NVIDIA H200")]


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("", "cuda"),
    ],
)
def test_gpu_kind_from_its_name(name: str, kind: str) -> None:
    assert gpu_kind(name) == kind


def test_auto_is_every_gpu_else_the_cpu() -> None:
    assert resolve_devices(EngineSettings(), gpus=[]) == [CPU]
    devices = resolve_devices(EngineSettings(devices="auto"), gpus=H200S)
    assert [(d.name, d.kind, d.pin) for d in devices] == [
        ("cuda:0", "h200", "GPU-aaaa"),
        ("cuda:1", "h200", "GPU-bbbb"),
    ]
    assert devices[1].worker_device == "cuda:0"  # the pinned process sees its GPU alone
    assert devices[1].env() == {"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}
    assert CPU.env() == {"CUDA_VISIBLE_DEVICES": ""} and CPU.worker_device == "cpu"


def test_explicit_device_lists() -> None:
    pick = resolve_devices(EngineSettings(devices="cuda:1"), gpus=H200S)
    assert [(d.name, d.pin) for d in pick] == [("cuda:1", "GPU-bbbb")]
    both = resolve_devices(EngineSettings(devices="cpu, cuda"), gpus=H200S)
    assert [d.name for d in both] == ["cpu", "cuda:0", "cuda:1"]
    # KILN_ENGINE_DEVICE alone still works: cuda = every GPU, cuda:N = that one.
    assert len(resolve_devices(EngineSettings(device="cuda"), gpus=H200S)) == 2
    assert resolve_devices(EngineSettings(device="cpu"), gpus=H200S) == [CPU]
    kind = resolve_devices(EngineSettings(devices="cuda:0", device_kind="H100"), gpus=H200S)
    assert kind[0].kind == "h100"
    # No way to list GPUs here: trust the name and pin by index.
    (blind,) = resolve_devices(EngineSettings(devices="cuda:3"), gpus=[])
    assert (blind.name, blind.pin, blind.kind) == ("cuda:3", "3", "cuda")


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("tpu:0", "unknown device 'tpu:0'"),
        ("cuda:5", "not visible: 2 GPU"),
        ("cuda:0,cuda:0", "each device once"),
    ],
)
def test_bad_device_lists(devices: str, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        resolve_devices(EngineSettings(devices=devices), gpus=H200S)


def test_cuda_requested_without_gpus_is_an_error() -> None:
    with pytest.raises(DeviceError, match="none is visible"):
        resolve_devices(EngineSettings(devices="cuda"), gpus=[])


def test_cuda_visible_devices_narrows_and_orders(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [("GPU-aaaa", "NVIDIA H100"), ("GPU-bbbb", "NVIDIA H100"), ("GPU-cccc", "NVIDIA H100")]
    monkeypatch.setattr(devmod, "_from_nvidia_smi", lambda: rows)
    assert [g.pin for g in devmod.visible_gpus({})] == ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]
    picked = devmod.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,0"})
    assert [(g.index, g.pin) for g in picked] == [(0, "GPU-cccc"), (1, "GPU-aaaa")]
    assert [g.pin for g in devmod.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-bb"})] == ["GPU-bbbb"]
    assert devmod.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert [g.pin for g in devmod.visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,0"})] == ["GPU-bbbb"]


def test_gpu_settings_take_the_cuda_defaults() -> None:
    gpus = resolve_devices(EngineSettings(), gpus=H200S)
    tuned = devmod.settings_for(EngineSettings(repeats=7), gpus)
    assert tuned.device == "cuda" and tuned.repeats == 7  # set: kept
    assert tuned.max_batch > EngineSettings().max_batch  # unset: the CUDA default
    cpu = EngineSettings()
    assert devmod.settings_for(cpu, [CPU]) is cpu


def _child_env(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    queue.put(os.environ.get("CUDA_VISIBLE_DEVICES"))


def test_a_spawned_engine_process_gets_its_pin() -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with _environ({"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}):
        child = ctx.Process(target=_child_env, args=(queue,))
        child.start()
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
    assert queue.get(timeout=60) == "GPU-bbbb"
    child.join(10)


def test_model_key_is_the_model_not_its_formatting_name_or_traffic() -> None:
    base = tiny_workload()
    key = model_key(base)
    assert len(key) == 12 and int(key, 16) >= 0
    reformatted = tiny_workload(name="other-name", batch=7, context=99)
    config = json.loads(reformatted["model"]["config_json"])
    reformatted["model"]["config_json"] = json.dumps(config, indent=2, sort_keys=True)
    assert model_key(reformatted) == key
    assert model_key(tiny_workload(dtype="bfloat16")) != key
    seeded = tiny_workload()
    seeded["model"]["seed"] = 8
    assert model_key(seeded) != key
    seeded["model"]["seed"] = "7"  # MessageToDict writes uint64 as a string
    assert model_key(seeded) == key


def test_device_kind_is_the_hardware_target() -> None:
    assert device_kind(tiny_workload()) == "cpu"
    assert device_kind({"hardware": {"name": "H100"}}) == "h100"
    assert device_kind({"hardware": {"name": "My GPU.v2"}}) == "my-gpu-v2"
    assert device_kind({}) == "cpu"


def test_work_subjects() -> None:
    w = work(Candidate())
    subject = w.subject("kiln")
    assert subject == f"kiln.work.experiments.cpu.fast.{w.model_key}"
    assert parse_work_subject("kiln", subject) == ("cpu", "fast", w.model_key)
    assert work_subject("kiln", "h200", "full", "abc") == "kiln.work.experiments.h200.full.abc"
    assert work_filter("kiln") == "kiln.work.experiments.*.*.*"
    assert work_filter("kiln", tier="fast") == "kiln.work.experiments.*.fast.*"
    assert durable_name("cpu", "fast", w.model_key) == f"ep-cpu-fast-{w.model_key}"
    for bad in ("kiln.work.experiments.fast", "kiln.work.experiments.cpu.slow.abc", "x.y"):
        with pytest.raises(InvalidArgument):
            parse_work_subject("kiln", bad)
    with pytest.raises(InvalidArgument, match="device kind"):
        work_subject("kiln", "h1.00", "fast", "abc")
    with pytest.raises(InvalidArgument, match="model key"):
        work_subject("kiln", "cpu", "fast", "*")


def test_cpu_engines_leave_a_core_to_the_services() -> None:
    from kiln.engine_pool.worker import cpu_threads

    assert cpu_threads("auto", cores=2) == 1
    assert cpu_threads("", cores=16) == 15
    assert cpu_threads("auto", cores=1) == 1
    assert cpu_threads("3", cores=2) == 3
    with pytest.raises(ValueError, match="KILN_ENGINE_THREADS"):
        cpu_threads("0", cores=2)


def test_full_tier_confirmations_time_more_steps() -> None:
    settings = EngineSettings()
    assert settings.min_repeats_for("fast") == settings.min_repeats == 5
    assert settings.min_repeats_for("full") == 10
    assert EngineSettings(min_repeats=12).min_repeats_for("full") == 12  # the larger applies
    assert EngineSettings(repeats=8).min_repeats_for("full") == 8  # capped by repeats
