"""What the gate drives in place of the measured model when the candidate runs in the sandbox
(rationale: docs/design/engine.md, "Sandbox"): one call's inputs go to the sandbox through
:class:`~kiln.runtime.sandbox.host.SandboxHost`, its output comes back.
"""

from __future__ import annotations

import torch

from kiln.runtime.op_profile import OpProfile
from kiln.runtime.sandbox import tensors
from kiln.runtime.sandbox.host import SandboxHost

Tensor = torch.Tensor


class _Layer:
    def __init__(self, model: SandboxModel, index: int) -> None:
        self._model, self._index = model, index

    def ffn(self, x: Tensor) -> Tensor:
        return self._model.ffn(self._index, x)


class _Ops:
    def __init__(self, model: SandboxModel, layers: int) -> None:
        self.layers = tuple(_Layer(model, i) for i in range(layers))


class SandboxModel:
    """What the gate drives in place of the measured model when the candidate runs in the
    sandbox: ``decode_step``, ``prefill`` and ``ops.layers[i].ffn`` send one call's inputs and
    return its output (a view of the shared buffer: copy before the next call).
    """

    def __init__(self, host: SandboxHost, layers: int) -> None:
        self.host = host
        self.ops = _Ops(self, layers)

    def _run(self, op: str, tokens: Tensor, **more: Tensor) -> Tensor:
        if self.host.device.type == "cuda":
            torch.cuda.synchronize(self.host.device)  # the poison lands before the sandbox writes
        header, payload = self.host._tokens_message(op, tokens, **more)
        return self.host.output(*self.host.call(header, payload))

    def decode_step(self, tokens: Tensor) -> Tensor:
        """``[B, 1]`` int64 -> the candidate's ``[B, V]`` logits."""
        return self._run("decode", tokens)

    def prefill(self, tokens: Tensor, seq_lens: Tensor | None = None) -> Tensor:
        """``[B, T]`` int64 prompts (``seq_lens [B]``) -> the candidate's ``[B, V]`` logits."""
        if seq_lens is None:
            return self._run("prefill", tokens)
        return self._run("prefill", tokens, seq_lens=seq_lens)

    def ffn(self, layer: int, x: Tensor) -> Tensor:
        """The candidate's ``ffn`` op of ``layer`` on ``x``."""
        data = tensors.tensor_bytes(x)
        header = {
            "op": "ffn",
            "layer": layer,
            "x": {**tensors.tensor_header(x), "nbytes": len(data)},
        }
        return self.host.output(*self.host.call(header, data))

    def profile(self, token: Tensor) -> OpProfile:
        """The sandbox's own per-op profile of one decode step (informational: measured in the
        candidate's process)."""
        header, payload = self.host._tokens_message("profile", token)
        reply, _ = self.host.call(header, payload)
        op_ms = {str(k): float(v) for k, v in dict(reply.get("op_ms") or {}).items()}
        shape = {str(k): int(v) for k, v in dict(reply.get("shape") or {}).items()}
        return OpProfile(op_ms=op_ms, shape=shape)

    def fill(self) -> None:
        """The sandbox's cache refilled as the judge fills its own."""
        self.host.call({"op": "fill"})

    def at_context(self) -> None:
        """The sandbox's sequences back at the operating point's context."""
        self.host.call({"op": "at_context"})
