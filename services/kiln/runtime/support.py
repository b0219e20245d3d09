"""What an engine runs for a model on a device: the one statement agents and engines share.

:func:`support_for` says per transform (and ``torch_compile`` mode), per op implementation and
per conflicting pair whether it applies and, if not, why. Agents search within it; engines
refuse with :meth:`ModelSupport.refusal`'s reason before binding. Unknown names are left to the
transforms and the registry. Importing does not import torch; :func:`support_for` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.domain.candidate import REFERENCE, Candidate, Transform
from kiln.workloads.config import ModelConfig, UnsupportedModelError, parse_config

Reason = str | None
"""Why something does not apply; None when it does."""

TRANSFORMS = ("threads", "torch_compile", "fused_decode", "cuda_graph")
"""The transforms engines know (:mod:`kiln.runtime.transforms`)."""
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""``torch_compile`` modes engines know."""
CUDA = "cuda"


class ModelNotSupported(ValueError):
    """kiln cannot parse or build the model, so it has no search space; the message says why."""


@dataclass(frozen=True)
class Conflict:
    """Transform ``transform`` and ``op`` bound to ``impl`` each apply, but not together."""

    transform: str
    op: str
    impl: str
    reason: str


@dataclass(frozen=True)
class ModelSupport:
    """What an engine on ``device_type`` runs for ``config``: ``transforms`` and
    ``compile_modes`` (name -> reason, None: applies), ``ops`` (op -> implementation -> reason),
    ``unused_ops`` and ``conflicts``.
    """

    config: ModelConfig = field(repr=False)
    device_type: str
    transforms: Mapping[str, Reason]
    compile_modes: Mapping[str, Reason]
    ops: Mapping[str, Mapping[str, Reason]]
    unused_ops: frozenset[str]
    conflicts: tuple[Conflict, ...] = ()

    def transform_reason(self, transform: Transform | str) -> Reason:
        """Why ``transform`` (a name or a transform with its mode) does not apply; None when it
        does or is unknown.
        """
        t = Transform(transform) if isinstance(transform, str) else transform
        reason = self.transforms.get(t.name)
        if reason is None and t.name == "torch_compile":
            reason = self.compile_modes.get(t.param("mode", "default"))
        return reason

    def op_reason(self, op: str, impl: str) -> Reason:
        """Why ``op`` bound to ``impl`` does not apply; None when it does, for ``reference`` and
        for names the registry does not know.
        """
        if impl == REFERENCE:
            return None
        if op in self.unused_ops:
            return _unused_reason(self.config, op)
        stated = self.ops.get(op, {})
        if impl in stated:
            return stated[impl]
        from kiln.ops import registry

        if op not in registry.OPS or impl not in registry.implementations(op):
            return None
        return _impl_reason(self.config, self.device_type, registry.get(op, impl))

    def transforms_refusal(
        self, transforms: Iterable[Transform], ops: Mapping[str, str] | None = None
    ) -> Reason:
        """The first reason ``transforms`` do not apply, alone or with ``ops``; None when they
        all do.
        """
        names = set()
        for t in transforms:
            names.add(t.name)
            reason = self.transform_reason(t)
            if reason is not None:
                return reason
        bound = ops or {}
        for c in self.conflicts:
            if c.transform in names and bound.get(c.op, REFERENCE) == c.impl:
                return c.reason
        return None

    def refusal(self, candidate: Candidate) -> Reason:
        """The first reason an engine refuses ``candidate`` (ops, transforms, conflicts), or
        None.
        """
        for op, impl in candidate.ops:
            reason = self.op_reason(op, impl)
            if reason is not None:
                return reason
        return self.transforms_refusal(candidate.transforms, dict(candidate.ops))

    def summary(self) -> list[str]:
        """One line per item that does not apply, ``what: reason`` (logs, tests)."""
        lines = [f"{n}: {r}" for n, r in self.transforms.items() if r]
        lines += [f"torch_compile({m}): {r}" for m, r in self.compile_modes.items() if r]
        for op, impls in self.ops.items():
            lines += [f"{op}={i}: {r}" for i, r in impls.items() if r]
        return lines + [f"{c.transform} + {c.op}={c.impl}: {c.reason}" for c in self.conflicts]


GQA_OPS = frozenset({"qkv_proj", "attention"})
"""The attention ops of a grouped-query (not latent) model."""
MLA_OPS = frozenset({"mla_proj", "mla_attention"})
"""The attention ops of a latent-attention (MLA) model."""
DSA_OPS = frozenset({"dsa_index_proj", "dsa_indexer"})
"""The sparse-attention indexer's ops (GLM-5 only)."""


def unused_ops(config: ModelConfig) -> frozenset[str]:
    """``moe`` in a dense model, ``mlp`` in a model whose every layer routes to experts and has
    no shared expert; the MLA ops in other models, ``qkv_proj`` and ``attention`` in MLA ones."""
    unused = set(GQA_OPS if config.mla is not None else MLA_OPS)
    if config.dsa is None:
        unused |= DSA_OPS
    shared = config.moe is not None and config.moe.num_shared_experts > 0
    if not config.is_moe:
        unused.add("moe")
    elif not shared and all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        unused.add("mlp")
    return frozenset(unused)


def device_kind(device: str) -> str:
    """``"cpu"``, ``"cuda"``, ... from a device string (``"cuda:1"`` -> ``"cuda"``)."""
    return device.strip().lower().split(":", 1)[0]


def _unused_reason(config: ModelConfig, op: str) -> str:
    if op in GQA_OPS:
        why = "its attention is latent (MLA)"
    elif op in DSA_OPS:
        why = "it has no sparse-attention indexer (GLM-5's)"
    elif op in MLA_OPS:
        why = "its attention is not latent (MLA)"
    else:
        why = "a dense model" if op == "moe" else "every layer routes to experts"
    return f"op {op!r}: {config.name} never calls it ({why})"


def _impl_reason(config: ModelConfig, device: str, impl: Any) -> Reason:
    name = f"{impl.op}={impl.name}"
    if not impl.runs_on(device):
        return f"{name} runs on {', '.join(impl.devices)} only, not on a {device} engine"
    return _missing_params(config, impl)


def _missing_params(config: ModelConfig, impl: Any) -> Reason:
    """Why ``impl`` cannot take the params ``config``'s sites add (gpt-oss: sinks, window,
    clamped SwiGLU; :data:`kiln.workloads.gpt_oss.SITE_PARAMS`; GLM-5: the indexer's
    ``topk_indices``, :data:`kiln.workloads.glm_moe_dsa.CALL_PARAMS`), or None; binding's
    signature check would refuse it too."""
    from kiln.workloads import glm_moe_dsa, gpt_oss

    if config.model_type == glm_moe_dsa.GLM_MOE_DSA:
        extra = glm_moe_dsa.CALL_PARAMS.get(impl.op, ())
    elif config.model_type == gpt_oss.GPT_OSS:
        extra = gpt_oss.SITE_PARAMS.get(impl.op, ())
    else:
        return None
    missing = _missing(impl.fn, extra)
    if not missing:
        return None
    family = (
        "GLM-5's sparse-attention indexer"
        if config.model_type == glm_moe_dsa.GLM_MOE_DSA
        else "gpt-oss"
    )
    family += f"; implementations that do: {_takers(impl.op, extra)}"
    return (
        f"{impl.op}={impl.name} does not implement {', '.join(missing)}, which "
        f"{config.name} needs ({family})"
    )


def _missing(fn: Any, extra: Iterable[str]) -> list[str]:
    """The names in ``extra`` that ``fn``'s signature cannot take."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return [p for p in extra if p not in params]


def _takers(op: str, extra: Iterable[str]) -> str:
    """``op=a, b``: the registered implementations of ``op`` that take every param in
    ``extra``."""
    from kiln.ops import registry

    names = [n for n in registry.implementations(op) if not _missing(registry.get(op, n).fn, extra)]
    return f"{op}={', '.join(names) or 'none'}"


def _triton_devices() -> tuple[str, ...]:
    from kiln.ops.kernels import runtime

    return (CUDA, "cpu") if runtime.interpreting() else (CUDA,)


def _transforms(config: ModelConfig, device: str) -> dict[str, Reason]:
    from kiln.runtime.fused_decode import unsupported_reason

    fused = unsupported_reason(config)
    if fused is None and device not in _triton_devices():
        fused = f"transform 'fused_decode' needs a CUDA engine (Triton kernels), not {device}"
    return {
        "threads": None,
        "torch_compile": None,
        "fused_decode": fused,
        "cuda_graph": None if device == CUDA else "transform 'cuda_graph' needs a CUDA engine",
    }


def _conflicts(config: ModelConfig, unused: frozenset[str]) -> tuple[Conflict, ...]:
    """``cuda_graph`` against every registered implementation that is not capturable."""
    from kiln.ops import registry

    return tuple(
        Conflict(
            "cuda_graph",
            op,
            name,
            f"cuda_graph with {op}={name}: it synchronises with the host, which a CUDA graph "
            f"cannot capture ({config.name}; pick an {op} implementation without that)",
        )
        for op in registry.ops()
        if op not in unused
        for name in registry.implementations(op)
        if not registry.get(op, name).capturable
    )


def _config(config: ModelConfig | Mapping[str, Any], name: str) -> ModelConfig:
    """``config`` parsed and checked buildable (ModelNotSupported)."""
    from kiln.workloads.models.build import UnbuildableModelError, check_buildable

    try:
        parsed = config if isinstance(config, ModelConfig) else parse_config(dict(config), name)
        check_buildable(parsed)
    except (UnsupportedModelError, UnbuildableModelError) as exc:
        raise ModelNotSupported(f"no search space: {exc}") from exc
    return parsed


def support_for(
    config: ModelConfig | Mapping[str, Any], device_type: str, *, name: str = "model"
) -> ModelSupport:
    """What an engine on ``device_type`` runs for ``config`` (or its ``config.json`` object);
    ModelNotSupported when kiln cannot parse or build it.
    """
    import kiln.ops  # noqa: F401  (registers the built-in implementations)
    from kiln.ops import registry

    model = _config(config, name)
    device = device_kind(device_type)
    unused = unused_ops(model)
    ops: dict[str, dict[str, Reason]] = {}
    for op in registry.ops():
        ops[op] = {REFERENCE: None}
        for impl in registry.implementations(op):
            if impl != REFERENCE:
                found = registry.get(op, impl)
                reason = _impl_reason(model, device, found)
                ops[op][impl] = _unused_reason(model, op) if op in unused else reason
    modes: dict[str, Reason] = dict.fromkeys(COMPILE_MODES)
    if device != CUDA:
        modes["reduce-overhead"] = (
            "torch_compile mode 'reduce-overhead' records CUDA graphs: CUDA engines only"
        )
    return ModelSupport(
        config=model,
        device_type=device,
        transforms=_transforms(model, device),
        compile_modes=modes,
        ops=ops,
        unused_ops=unused,
        conflicts=_conflicts(model, unused) if device == CUDA else (),
    )
