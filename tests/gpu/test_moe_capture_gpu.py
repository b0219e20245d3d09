"""Every ``moe`` implementation inside a CUDA graph and under ``torch.compile`` on CUDA (skipped
without it): Qwen3-30B-A3B's and Mixtral-8x7B's expert shapes (scaled down in expert count to keep
memory small), bf16, at decode batches 1 and 30. A host synchronisation would fail the capture;
a data-dependent shape would fail the replay's equality with eager.

Run on a GPU host: ``pytest --noconftest tests/gpu/test_moe_capture_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHAPES = {
    # name: (experts, hidden, expert width, top_k, norm_topk_prob, round_router_weights)
    "qwen3-30b-a3b": (32, 2048, 768, 8, True, True),
    "mixtral-8x7b": (8, 4096, 1024, 2, True, False),
}


def _params(shape: tuple[Any, ...]) -> dict[str, Any]:
    e, h, i, k, norm, rounded = shape
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*size: int, scale: float) -> torch.Tensor:
        t = torch.randn(*size, device="cuda", generator=g) * scale
        return t.to(torch.bfloat16)

    return {
        "router_weight": rand(e, h, scale=0.05),
        "gate_up_weight": rand(e, 2 * i, h, scale=0.02),
        "down_weight": rand(e, h, i, scale=0.02),
        "top_k": k,
        "norm_topk_prob": norm,
        "round_router_weights": rounded,
        "router_bias": None,
    }


def _impls() -> list[str]:
    import kiln.ops  # noqa: F401
    from kiln.ops.registry import implementations

    return list(implementations("moe"))


@pytest.mark.parametrize("batch", [1, 30])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("impl", _impls())
def test_moe_captures_in_a_cuda_graph(impl: str, shape: str, batch: int) -> None:
    from kiln.ops.registry import get

    p = _params(SHAPES[shape])
    fn = get("moe", impl)
    x = torch.randn(batch, 1, p["router_weight"].shape[1], device="cuda").to(torch.bfloat16)
    eager = fn(x, **p)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(static_x, **p)  # warm-up off the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(static_x, **p)
    fresh = torch.randn_like(x)
    static_x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn(fresh, **p)), "replay differs from eager on new inputs"
    assert eager.shape == out.shape


@pytest.mark.parametrize("impl", _impls())
def test_moe_compiles_with_inductor(impl: str) -> None:
    from kiln.ops.registry import get

    p = _params(SHAPES["qwen3-30b-a3b"])
    fn = get("moe", impl)
    x = torch.randn(30, 1, 2048, device="cuda").to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: fn(t, **p), fullgraph=True)
    want = fn(x, **p).float()
    got = compiled(x).float()
    assert (got - want).abs().max().item() <= 2e-2 * max(want.abs().max().item(), 1.0)
