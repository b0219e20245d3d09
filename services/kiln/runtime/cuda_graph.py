"""The ``cuda_graph`` transform: the whole decode step at the traffic shape as one CUDA graph
(rationale: docs/design/engine.md). Only the captured shape replays; any other call runs eagerly
through the same bound ops. The host follows the lengths the graph advances through
:meth:`StaticKVCache.advanced_on_device`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kiln.workloads.models import DecoderModel

Tensor = torch.Tensor
WARMUP_ITERS = 2
"""Eager decode steps on a side stream before capture (PyTorch's example uses 3; 2 suffice for
eager ops, and ``torch.compile`` compiles on the first)."""


class DecodeGraph:
    """A captured decode step of ``model`` (on CUDA, its cache at the operating point) at the
    active batch; ``capture_ms`` is warm-up plus capture. RuntimeError when not on CUDA or
    capture fails.
    """

    def __init__(self, model: DecoderModel, warmup_iters: int = WARMUP_ITERS) -> None:
        cache = model.cache
        device = cache.lengths.device
        if device.type != "cuda":
            raise RuntimeError(f"cuda_graph needs a CUDA engine, this one runs on {device}")
        start = time.perf_counter()
        self.model = model
        self.batch = cache.batch
        self._eager: Callable[[Tensor], Tensor] = model.decode_step
        self._tokens = torch.zeros((self.batch, 1), dtype=torch.int64, device=device)
        saved = cache.state()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup_iters):
                self._eager(self._tokens)
                cache.restore_state(saved)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = self._eager(self._tokens)
        cache.restore_state(saved)  # capture recorded the step; it did not run it
        torch.cuda.synchronize(device)
        self.capture_ms = (time.perf_counter() - start) * 1e3

    def __call__(self, tokens: Tensor) -> Tensor:
        """Decode step (the contract of :meth:`DecoderModel.decode_step`): replays for ``[batch,
        1]``, else eager. On replay the logits are the graph's static buffer, overwritten by the
        next call.
        """
        cache = self.model.cache
        if tokens.shape != self._tokens.shape or cache.batch != self.batch:
            return self._eager(tokens)
        cache.next_positions()  # raises CacheCapacityError exactly as the eager step would
        self._tokens.copy_(tokens)
        self.graph.replay()
        cache.advanced_on_device(1)
        return self._out

    def release(self) -> None:
        """Drop the graph and its memory pool's tensors."""
        del self.graph, self._out, self._tokens


def install(model: DecoderModel) -> tuple[DecodeGraph, Callable[[], None]]:
    """Capture ``model``'s decode step and route this instance's ``decode_step`` through it;
    returns the graph and the undo. RuntimeError as :class:`DecodeGraph`.
    """
    graph = DecodeGraph(model)
    model.__dict__["decode_step"] = graph

    def undo() -> None:
        model.__dict__.pop("decode_step", None)
        graph.release()
        torch.cuda.empty_cache()

    return graph, undo
