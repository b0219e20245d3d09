"""The sandbox process: the candidate's side of the process split (rationale:
docs/design/engine.md, "Sandbox"; the judge's side is :mod:`kiln.runtime.sandbox.host`).

Started by the judge as ``python -I -c BOOT <socket fd> <judge pid> <home> <sys.path json>``; it
confines itself (:func:`~kiln.runtime.sandbox.confine.confine`) before importing torch, reads
the hello (spec, weight manifest, output buffer), maps the judge's weights, builds its own
model and KV cache over them (same shapes, same seeded fill as the judge's measured cache), runs
one reference step and prefill (first-use costs), says ``ready``, then answers one command at a
time (:data:`COMMANDS`). It never sees the check's seed, the reference or a step's tokens before
that step. Outputs go to the shared buffer (or inline when they do not fit); exceptions come back
as text; what it reports is never trusted for a verdict.
"""

from __future__ import annotations

import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[4]); "
    "from kiln.runtime.sandbox.server import main; main()"
)
"""The ``-c`` program the judge starts (sys.path as the judge's, then :func:`main`)."""
COMMANDS = (
    "echo",
    "load",
    "unload",
    "fill",
    "at_context",
    "decode",
    "prefill",
    "ffn",
    "profile",
    "stop",
)
"""What the judge may ask (the header's ``op``)."""
TRACEBACK_CHARS = 1500


def main() -> None:
    """Entry point (``BOOT``): argv is ``<socket fd> <judge pid> <home> <paths>``."""
    from kiln.runtime.sandbox.confine import confine
    from kiln.runtime.sandbox.user import SandboxUser

    fd, judge_pid, home = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sock = socket.socket(fileno=fd)
    from kiln.runtime.sandbox import wire

    hello, _ = wire.receive(sock)
    user = hello.get("user")
    refused = confine(
        judge_pid,
        home,
        address_space=int(hello.get("address_space", 0)),
        network=bool(hello.get("unshare_network", True)),
        user=SandboxUser(int(user["uid"]), int(user["gid"])) if user else None,
    )
    try:
        server = _Server(sock, hello)
    except Exception as exc:
        wire.send(sock, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"})
        return
    from kiln.runtime.sandbox.processes import host_pid

    wire.send(sock, {"op": "ready", "pid": host_pid(), "confinement": refused})
    server.serve()


def _crash(exc: BaseException) -> str:
    tail = "".join(traceback.format_exception(exc))[-TRACEBACK_CHARS:]
    return f"{type(exc).__name__}: {exc}\n{tail}"


class _Server:
    """The sandbox's model and the command loop."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any]) -> None:
        import torch

        from kiln.runtime.reload import RegistrySnapshot
        from kiln.runtime.sandbox.memory import SharedBuffer, map_weights
        from kiln.runtime.spec import EngineSpec
        from kiln.workloads.models import DecoderModel
        from kiln.workloads.models.kv_cache import StaticKVCache

        self.sock = sock
        torch.set_num_threads(int(hello["threads"]))
        self.threads = int(hello["threads"])
        spec = self.spec = EngineSpec.from_dict(hello["spec"])
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, spec.dtype)
        config = spec.model_config().with_layers(spec.layers)
        store, self._mapping = map_weights(
            hello["weights"],
            int(hello["weights_fd"]),
            int(hello["weights_bytes"]),
            device=self.device,
        )
        self.weights = store
        out = hello["out"]
        self.out = SharedBuffer.open(int(out["fd"]), int(out["nbytes"]), self.device)
        cache = StaticKVCache.for_config(
            config,
            max_batch=spec.batch_size,
            max_len=spec.cache_len,
            dtype=self.dtype,
            device=self.device,
        )
        self.model = DecoderModel(config, store, cache)
        self.context = torch.full((spec.batch_size,), spec.context_len, dtype=torch.int64)
        self.context = self.context.to(self.device)
        self.registry = RegistrySnapshot.take()
        self.vocab = config.vocab_size
        self.loaded: list[Any] = []
        self.candidate: Any = None
        self.applied: Any = None
        self.model_attributes: Any = None
        self.derived_before: set[str] = set()
        self._zeros = torch.zeros((spec.batch_size, self.vocab), device=self.device)
        tokens = torch.zeros((spec.batch_size, 1), dtype=torch.int64, device=self.device)
        self.fill()
        self.model.decode_step(tokens)
        prompt = torch.zeros((spec.check_batch, spec.prompt_len), dtype=torch.int64)
        self.model.prefill(prompt.to(self.device))
        self.fill()
        self.sync()
        from kiln.runtime.integrity import HarnessFingerprint

        # taken before any candidate: a sandbox whose candidate changed it is replaced
        self.fingerprint = HarnessFingerprint.take()

    # ------------------------------------------------------------------ state
    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def fill(self) -> None:
        """The judge's fill (``Engine._fill_cache``): seeded K/V, sequences at context."""
        import torch

        g = torch.Generator(device=self.device).manual_seed(self.spec.seed + 1)
        with torch.no_grad():
            for t in self.model.cache.k + self.model.cache.v:
                t.normal_(generator=g)
        self.at_context()

    def at_context(self) -> None:
        self.model.cache.start(self.context, self.spec.context_len)

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        from kiln.runtime.sandbox import wire

        handlers: dict[str, Callable[[dict[str, Any], bytearray], None]] = {
            "echo": self._echo,
            "load": self._load,
            "unload": self._unload,
            "fill": lambda h, p: self._done(self.fill),
            "at_context": lambda h, p: self._done(self.at_context),
            "decode": self._decode,
            "prefill": self._prefill,
            "ffn": self._ffn,
            "profile": self._profile,
        }
        while True:
            try:
                header, payload = wire.receive(self.sock)
            except (wire.WireError, OSError):
                return
            op = header.get("op")
            if op == "stop":
                return
            handler = handlers.get(str(op))
            if handler is None:
                wire.send(self.sock, {"error": f"unknown command {op!r}"})
                continue
            handler(header, payload)

    def _send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        from kiln.runtime.sandbox import wire

        wire.send(self.sock, header, payload)

    def _done(self, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.sync()
        except (Exception, SystemExit) as exc:
            self._send({"raised": _crash(exc)})
            return
        self._send({"ok": True})

    def _tensor(self, header: dict[str, Any], payload: bytearray, key: str, start: int = 0) -> Any:
        from kiln.runtime.sandbox import tensors

        meta = header[key]
        return tensors.from_bytes(meta, payload[start : start + int(meta["nbytes"])]).to(
            self.device
        )

    def _output(self, out: object) -> None:
        """Reply with ``out``: refused unless a plain tensor; into the shared buffer (synced)
        when it fits, else inline."""
        import torch

        from kiln.runtime.check import not_plain
        from kiln.runtime.sandbox import tensors
        from kiln.runtime.sandbox.memory import fit

        why = not_plain(out)
        if why or not isinstance(out, torch.Tensor):
            self._send({"not_plain": why})
            return
        meta = tensors.tensor_header(out)
        with torch._C.DisableTorchFunction():
            try:
                target = fit(self.out, out.dtype, list(out.shape))
            except ValueError:
                self.sync()
                self._send({"out": meta, "inline": True}, tensors.tensor_bytes(out))
                return
            target.copy_(out)
            self.sync()
        self._send({"out": meta})

    def _call(self, fn: Callable[[], object]) -> None:
        try:
            out = fn()
        except (Exception, SystemExit) as exc:
            self._send({"raised": _crash(exc)})
            return
        try:
            self._output(out)
        except (Exception, SystemExit) as exc:
            self._send({"raised": _crash(exc)})

    # ------------------------------------------------------------------ commands
    def _echo(self, header: dict[str, Any], payload: bytearray) -> None:
        """What a decode costs besides the forward: the tokens in, a [B, V] float32 out."""
        self._tensor(header, payload, "tokens")
        self._output(self._zeros)

    def _decode(self, header: dict[str, Any], payload: bytearray) -> None:
        tokens = self._tensor(header, payload, "tokens")
        self._call(lambda: self.model.decode_step(tokens))

    def _prefill(self, header: dict[str, Any], payload: bytearray) -> None:
        tokens = self._tensor(header, payload, "tokens")
        seq_lens = None
        if "seq_lens" in header:
            seq_lens = self._tensor(header, payload, "seq_lens", int(header["tokens"]["nbytes"]))
        self._call(lambda: self.model.prefill(tokens, seq_lens))

    def _ffn(self, header: dict[str, Any], payload: bytearray) -> None:
        x = self._tensor(header, payload, "x")
        layer = int(header["layer"])
        self._call(lambda: self.model.ops.layers[layer].ffn(x))

    def _profile(self, header: dict[str, Any], payload: bytearray) -> None:
        from kiln.runtime.op_profile import profile_decode_step

        token = self._tensor(header, payload, "tokens")
        try:
            profile = profile_decode_step(self.model, token, self.at_context, self.dtype)
        except (Exception, SystemExit) as exc:
            self._send({"raised": _crash(exc)})
            return
        self._send({"op_ms": profile.op_ms, "shape": profile.shape})

    def _load(self, header: dict[str, Any], payload: bytearray) -> None:
        """Load, bind and transform a candidate: ``{"phases", "notes"}``, or ``{"rejected"}`` /
        ``{"raised"}`` with the phase."""
        import time

        from kiln.domain.candidate import Candidate
        from kiln.ops.registry import OpLookupError
        from kiln.runtime.attributes import AttributeSnapshot
        from kiln.runtime.reload import load_code_modules
        from kiln.runtime.support import support_for
        from kiln.runtime.transforms import RejectedCandidate, apply_transforms
        from kiln.workloads.models import OpBinding
        from kiln.workloads.models.binding import BindError, LossyImplementationError

        candidate = self.candidate = Candidate.from_canonical(header["candidate"])
        self.derived_before = {name for name, _ in self.weights.derived_keys()}
        self.model_attributes = AttributeSnapshot(
            "sandbox.model", self.model, True, ignore=("binding", "ops")
        ).take()
        phases: dict[str, float] = {}
        phase = "load"
        try:
            start = time.perf_counter()
            self.loaded = load_code_modules(candidate.code_modules)
            phases["load"] = (time.perf_counter() - start) * 1e3
            phase, start = "bind", time.perf_counter()
            support = support_for(self.spec.model_config(), self.device.type)
            refusal = support.refusal(candidate)
            if refusal is not None:
                raise RejectedCandidate(refusal)
            try:
                binding = OpBinding.from_recipe(dict(candidate.ops), allow_lossy=candidate.lossy)
                self.model.rebind(binding)
            except (OpLookupError, LossyImplementationError, BindError) as exc:
                raise RejectedCandidate(str(exc)) from exc
            self.applied = apply_transforms(self.model, candidate.transforms, support)
            self.sync()
            phases["bind"] = (time.perf_counter() - start) * 1e3
            for name, ms in self.applied.phases_ms.items():
                phases["bind"] -= ms
                phases[name] = ms
        except RejectedCandidate as exc:
            self._send({"rejected": f"{phase}: {exc}", "phases": phases})
            return
        except (Exception, SystemExit) as exc:
            self._send({"raised": _crash(exc), "phase": phase, "phases": phases})
            return
        self._send({"phases": phases, "notes": list(self.applied.notes)})

    def _unload(self, header: dict[str, Any], payload: bytearray) -> None:
        """Put the sandbox back; ``{"clean", "changes", "played"}``: ``clean`` when nothing the
        candidate could leave for the next one is left (the judge restarts the sandbox
        otherwise); ``played``: per module defining ``_played`` (the red team's record of a
        trick played), its length."""
        import torch

        from kiln.runtime.reload import forget_sources
        from kiln.runtime.thread_watch import ThreadWatch
        from kiln.workloads.models import OpBinding

        changes: list[str] = []
        played = {
            str(getattr(ns, "__name__", "?")): len(vars(ns)["_played"])
            for ns in self.loaded
            if isinstance(vars(ns).get("_played"), list)
        }
        try:
            if self.applied is not None:
                self.applied.revert()
            torch.set_num_threads(self.threads)
            if self.candidate is not None:
                forget_sources(self.candidate.code_modules)
            if not self.registry.restore():
                changes.append("a code module registered a reference implementation")
            for name in {n for n, _ in self.weights.derived_keys()} - self.derived_before:
                self.weights.drop_derived(name)
            self.model.rebind(OpBinding.from_recipe())
            changes += self.fingerprint.refresh()  # against the pristine process's
            if self.model_attributes is not None:
                changes += self.model_attributes.changes()
            changes += ThreadWatch().strays(new_threads=False)
            self.fill()
        except (Exception, SystemExit) as exc:
            changes.append(f"putting the sandbox back failed: {type(exc).__name__}: {exc}")
        self.loaded, self.candidate, self.applied, self.model_attributes = [], None, None, None
        self._send({"clean": not changes, "changes": changes[:8], "played": played})
