"""Sizing a CUDA engine's KV cache from free memory (pure arithmetic, runs on CPU)."""

from __future__ import annotations

import pytest

from kiln.runtime.device_memory import (
    RESERVE_BYTES,
    DeviceMemoryError,
    fit_batch,
    kv_bytes_per_sequence,
)
from kiln.runtime.spec import EngineLimits, EngineSpec
from tests.unit.engine_testing import tiny_workload

GIB = 1 << 30


def _spec(batch: int, context: int) -> EngineSpec:
    limits = EngineLimits(device="cuda:0", max_batch=10**6, max_context=4000)
    workload = tiny_workload(batch=batch, context=context, dtype="bfloat16")
    return EngineSpec.from_workload(workload, "full", limits)


def test_kv_bytes_follow_the_architecture() -> None:
    spec = _spec(1, 100)
    cfg = spec.model_config()
    # 2 (K and V) x 3 layers x 2 KV heads x 101 slots x 32 dims x 2 bytes
    assert kv_bytes_per_sequence(cfg, spec.layers, spec.cache_len, 2) == 2 * 3 * 2 * 101 * 32 * 2


def test_a_shape_that_fits_is_kept() -> None:
    spec = _spec(16, 1000)
    assert fit_batch(spec, spec.model_config(), 80 * GIB) == spec


def test_the_batch_is_lowered_to_what_fits_and_noted() -> None:
    spec = _spec(60_000, 4000)
    fitted = fit_batch(spec, spec.model_config(), 3 * GIB)
    assert 1 <= fitted.batch_size < 60_000
    assert fitted.check_batch <= fitted.batch_size
    assert any("batch lowered from 60000" in note for note in fitted.notes)
    bigger = fit_batch(spec, spec.model_config(), 6 * GIB)
    assert bigger.batch_size > fitted.batch_size


def test_nothing_fits_is_a_clear_error() -> None:
    spec = _spec(4, 4000)
    with pytest.raises(DeviceMemoryError, match="GiB are free on cuda:0"):
        fit_batch(spec, spec.model_config(), RESERVE_BYTES)
