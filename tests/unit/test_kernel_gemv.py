"""``kiln.ops.kernels.gemv`` against its plain-PyTorch reference over odd shapes and configs.

Triton decides at its first import whether kernels run compiled or under the interpreter, so on a
host without CUDA this module sets ``TRITON_INTERPRET=1`` before anything imports Triton (kiln
imports Triton only in the kernel modules, which nothing imports at collection time before this
module). The variable stays set for the rest of the session (only where CUDA is absent, so no
compiled kernel is affected). With CUDA the same tests run compiled on the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from kiln.ops.kernels import gemv as G
from kiln.ops.kernels import gemv_config as GC
from tests.unit.op_testing import DTYPES, assert_close, randn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _poison(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs the kernels allocate start as NaN: an unwritten element fails the comparison."""
    monkeypatch.setattr(G, "POISON_OUTPUTS", True)


def _rand(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return randn(*shape, dtype=dtype, scale=scale).to(DEVICE)


CASES = [
    # (M, N, K, config); N and K are not multiples of the blocks
    (1, 37, 100, G.GemvConfig(block_n=16, block_k=32)),
    (3, 45, 130, G.GemvConfig(block_n=16, block_k=32, split_k=3)),
    (5, 20, 70, None),
    (2, 33, 64, G.GemvConfig(block_n=32, block_k=16, split_k=2, num_warps=2)),
    # PDL asked for where there is none (the interpreter): an ordinary launch, same result
    (2, 40, 90, G.GemvConfig(block_n=8, block_k=32, split_k=2, pdl=2)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k", "config"), CASES)
def test_matches_reference(
    dtype: torch.dtype, m: int, n: int, k: int, config: G.GemvConfig | None
) -> None:
    x = _rand(m, k, dtype=dtype)
    w = _rand(n, k, dtype=dtype, scale=k**-0.5)
    bias = _rand(n, dtype=dtype) if m % 2 else None
    res = _rand(m, n, dtype=dtype) if m != 5 else None
    got = G.gemv(x, w, bias=bias, residual=res, config=config)
    want = G.gemv_reference(x, w, bias=bias, residual=res)
    assert not got.isnan().any()
    assert_close(got, want)


@pytest.mark.parametrize("split_k", [1, 2])
def test_out_dtype_float32_rounds_to_model_dtype_first(split_k: int) -> None:
    x = _rand(2, 50, dtype=torch.bfloat16)
    w = _rand(24, 50, dtype=torch.bfloat16, scale=0.3)
    cfg = G.GemvConfig(block_n=16, block_k=16, split_k=split_k)
    got = G.gemv(x, w, out_dtype=torch.float32, config=cfg)
    want = torch.nn.functional.linear(x, w).float()
    assert got.dtype == torch.float32
    # values are bfloat16 numbers (rounded first), not the float32 accumulator
    torch.testing.assert_close(got, got.bfloat16().float(), atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_residual_added_after_rounding() -> None:
    """bf16: ``round(round(x @ w.T) + r)``, the rounding of kiln's o_proj then residual add."""
    x = _rand(1, 40, dtype=torch.bfloat16)
    w = _rand(16, 40, dtype=torch.bfloat16, scale=0.2)
    r = _rand(1, 16, dtype=torch.bfloat16, scale=50.0)
    want = torch.nn.functional.linear(x, w) + r
    got = G.gemv(x, w, residual=r, config=G.GemvConfig(block_n=16, block_k=64))
    assert torch.equal(G.gemv_reference(x, w, residual=r), want)
    assert_close(got, want)


def test_nan_in_a_row_propagates_to_that_row_only() -> None:
    x = _rand(2, 30, dtype=torch.float32)
    x[1, 7] = float("nan")
    w = _rand(20, 30, dtype=torch.float32)
    got = G.gemv(x, w, config=G.GemvConfig(block_n=16, block_k=16))
    assert got[1].isnan().all()
    assert not got[0].isnan().any()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_n": 3},
        {"block_k": 8},
        {"block_k": 24},
        {"split_k": 0},
        {"split_k": 65},
        {"num_warps": 3},
        {"num_stages": 0},
        {"block_n": 1.0},
        {"pdl": 3},
        {"pdl": -1},
    ],
)
def test_config_validation(kwargs: dict[str, object]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"GemvConfig.{name}"):
        G.GemvConfig(**kwargs)  # type: ignore[arg-type]


def test_default_config_under_the_interpreter_uses_the_fewest_programs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(GC.runtime, "interpreting", lambda: True)
    cfg = GC.default_config(512, 64, m=8)
    assert (cfg.block_n, cfg.block_k, cfg.split_k) == (256, 64, 1)
    assert GC.default_config(3, 20000).block_k == 8192


def test_default_config_fills_the_gpu_at_llama_1b_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GC.runtime, "interpreting", lambda: False)  # the rule for a GPU
    # Small batch: the rule measured on an H200 (many programs, thin tiles, no split).
    expected = {
        (3072, 2048): (1, 2048),  # qkv
        (2048, 2048): (1, 2048),  # o_proj
        (2048, 8192): (1, 2048),  # down
        (128256, 2048): (16, 1024),  # lm_head
    }
    for (n, k), (block_n, block_k) in expected.items():
        cfg = GC.default_config(n, k)
        assert (cfg.block_n, cfg.block_k, cfg.split_k) == (block_n, block_k, 1), (n, k, cfg)
        assert -(-n // cfg.block_n) >= GC.SMALL_M_PROGRAMS
    paired = GC.default_config(8192, 2048, paired=True)  # gate/up row pairs
    assert (paired.block_n, paired.block_k) == (4, 2048)
    assert GC.default_config(100, 300).block_k == 512  # next_power_of_2(300): one chunk
    # Larger batches keep the register budget and split tall-K shapes over the SMs.
    for n, k in [(3072, 2048), (2048, 8192), (128256, 2048)]:
        cfg = GC.default_config(n, k, m=16)
        assert cfg.block_n * cfg.block_k <= GC.TILE_BUDGET
    tall = GC.default_config(64, 16384, m=16)  # few rows, long K: split the reduction
    assert tall.split_k > 1
    assert -(-64 // tall.block_n) * tall.split_k >= GC.DEFAULT_SMS


def test_bad_inputs_raise_clear_errors() -> None:
    x = _rand(2, 16, dtype=torch.float32)
    w = _rand(8, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="rows"):
        G.gemv(_rand(G.MAX_M + 1, 16, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="K=16"):
        G.gemv(x, _rand(8, 15, dtype=torch.float32))
    with pytest.raises(ValueError, match="dtype"):
        G.gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        G.gemv(x, _rand(16, 8, dtype=torch.float32).t())
    with pytest.raises(ValueError, match="bias"):
        G.gemv(x, w, bias=_rand(7, dtype=torch.float32))
    with pytest.raises(ValueError, match="residual"):
        G.gemv(x, w, residual=_rand(2, 7, dtype=torch.float32))
    with pytest.raises(ValueError, match="2-D"):
        G.gemv(x[None], w)


def test_pdl_launch_mode_falls_back_where_there_is_no_pdl() -> None:
    from kiln.ops.kernels.pdl import launch_mode, pdl_options

    assert [launch_mode(p, torch.device("cpu")) for p in (0, 1, 2)] == [0, 0, 0]
    assert pdl_options(0) == {} and pdl_options(2) == {"launch_pdl": True}
    with pytest.raises(ValueError, match="pdl must be 0, 1 or 2"):
        launch_mode(3, torch.device("cpu"))
