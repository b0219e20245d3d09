"""gpt-oss's experts: biases and the clamped SwiGLU (transformers' ``GptOssExperts``, 5.x).

For an expert ``e`` and its rows ``x``: ``gu = x @ W_gu[e].T + b_gu[e]``, ``gate, up`` its two
halves (kiln's layout, gate first; the checkpoint interleaves them, see
:mod:`kiln.workloads.gpt_oss_weights`), ``gate = min(gate, limit)``, ``up = clamp(up, -limit,
limit)``, ``h = (up + 1) * gate * sigmoid(alpha * gate)``, ``y = h @ W_down[e].T + b_down[e]``,
each step in the model dtype. The ``moe`` op's ``reference`` takes it as its ``swiglu`` param
(:class:`ClampedSwiGLU`); the other ``moe`` implementations do not, so binding refuses them for
gpt-oss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class ClampedSwiGLU:
    """The experts' biases ``gate_up_bias [E, 2I]`` (gate first) and ``down_bias [E, H]`` (model
    dtype), ``alpha`` and ``limit``."""

    gate_up_bias: Tensor
    down_bias: Tensor
    alpha: float
    limit: float

    def activate(self, gate_up: Tensor, experts: Tensor) -> Tensor:
        """``[S, 2I]`` rows of ``x @ W_gu.T`` (no bias yet) of assignments to ``experts [S]`` ->
        ``[S, I]`` clamped SwiGLU outputs."""
        gate, up = (gate_up + self.gate_up_bias[experts]).chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def finish(self, down: Tensor, experts: Tensor) -> Tensor:
        """``[S, H]`` rows of ``h @ W_down.T`` plus each assignment's expert's down bias."""
        return down + self.down_bias[experts]
