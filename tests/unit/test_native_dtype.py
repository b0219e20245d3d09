"""An engine serves a model in its config's dtype only where the device computes it natively."""

from __future__ import annotations

from pathlib import Path

from kiln.runtime.native_dtype import cpu_flags, is_native
from kiln.runtime.spec import EngineLimits, EngineSpec
from tests.unit.engine_testing import tiny_workload

SAPPHIRE_RAPIDS = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
SKYLAKE = frozenset({"avx2", "avx512f", "fma"})


def test_bf16_is_native_only_with_a_bf16_dot_product() -> None:
    assert is_native("bfloat16", "cpu", SAPPHIRE_RAPIDS)
    assert not is_native("bfloat16", "cpu", SKYLAKE)
    assert not is_native("float16", "cpu", SAPPHIRE_RAPIDS)
    assert is_native("float16", "cpu", SAPPHIRE_RAPIDS | {"amx_fp16"})
    assert is_native("float32", "cpu", frozenset())
    assert is_native("bfloat16", "cuda:0", frozenset())


def test_cpu_flags_reads_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: x\nflags\t\t: fpu avx512_bf16 amx_bf16\n\n")
    assert cpu_flags(str(info)) == {"fpu", "avx512_bf16", "amx_bf16"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_unset_dtype_follows_the_config_where_native() -> None:
    spec = EngineSpec.from_workload(tiny_workload(dtype=""), "fast", EngineLimits())
    expected = "bfloat16" if is_native("bfloat16", "cpu") else "float32"
    assert spec.dtype == expected
    assert any("workload.model.dtype unset" in note and expected in note for note in spec.notes)
    on_gpu = EngineSpec.from_workload(tiny_workload(dtype=""), "fast", EngineLimits("cuda:0"))
    assert on_gpu.dtype == "bfloat16"
    forced = EngineSpec.from_workload(
        tiny_workload(dtype=""), "fast", EngineLimits(dtype="float16")
    )
    assert forced.dtype == "float16"
