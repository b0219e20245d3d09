"""Candidates: forward-pass variants, content-addressed.

A candidate is a *recipe* — an implementation name per op (``{"attention": "sdpa"}``; ops not
named use ``reference``) and whole-forward transforms with parameters (``torch_compile``,
``threads``, ``cuda_graph``, ...) — plus optional *code modules* (source text registering new op
implementations). Its id is the SHA-256 of its canonical JSON, so the same content always has
the same id and two agents proposing the same variant collide on the board's claim.

Importable without protobuf; ``to_proto``/``from_proto`` import ``kiln.v1`` lazily.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

REFERENCE = "reference"


@dataclass(frozen=True)
class Transform:
    """A whole-forward transform, e.g. ``Transform("torch_compile", {"mode": "default"})``.
    Parameter values are strings (they travel as proto map<string,string>)."""

    name: str
    params: tuple[tuple[str, str], ...] = ()

    @staticmethod
    def of(name: str, **params: Any) -> Transform:
        """A transform with parameters given as keywords (values turned into strings)."""
        return Transform(name, tuple(sorted((k, str(v)) for k, v in params.items())))

    def param(self, key: str, default: str = "") -> str:
        """One parameter's value."""
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class CodeModule:
    """Source text that registers op implementations when an engine loads it."""

    name: str
    source: str


@dataclass(frozen=True)
class Candidate:
    """A forward-pass variant. ``ops`` maps op name → implementation name (reference entries
    are dropped, so ``{}`` is the reference forward); transforms are kept sorted by name."""

    ops: tuple[tuple[str, str], ...] = ()
    transforms: tuple[Transform, ...] = ()
    code_modules: tuple[CodeModule, ...] = ()
    lossy: bool = False
    id: str = field(init=False, default="")

    def __post_init__(self) -> None:
        ops = tuple(sorted((k, v) for k, v in dict(self.ops).items() if v != REFERENCE))
        transforms = tuple(sorted(self.transforms, key=lambda t: t.name))
        names = [t.name for t in transforms]
        if len(set(names)) != len(names):
            raise ValueError(f"a transform appears twice: {names}")
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "transforms", transforms)
        object.__setattr__(self, "id", _digest(self.canonical()))

    @staticmethod
    def make(
        ops: dict[str, str] | None = None,
        transforms: list[Transform] | None = None,
        code_modules: list[CodeModule] | None = None,
        lossy: bool = False,
    ) -> Candidate:
        """A candidate from plain collections."""
        return Candidate(
            tuple((ops or {}).items()), tuple(transforms or ()), tuple(code_modules or ()), lossy
        )

    def canonical(self) -> dict[str, Any]:
        """The JSON-compatible content the id is computed from (also the ledger payload)."""
        return {
            "ops": dict(self.ops),
            "transforms": [{"name": t.name, "params": dict(t.params)} for t in self.transforms],
            "code_modules": [{"name": m.name, "source": m.source} for m in self.code_modules],
            "lossy": self.lossy,
        }

    @staticmethod
    def from_canonical(obj: dict[str, Any]) -> Candidate:
        """Inverse of :meth:`canonical`. Raises KeyError/TypeError on malformed input."""
        return Candidate.make(
            dict(obj.get("ops", {})),
            [Transform.of(t["name"], **t.get("params", {})) for t in obj.get("transforms", [])],
            [CodeModule(m["name"], m["source"]) for m in obj.get("code_modules", [])],
            bool(obj.get("lossy", False)),
        )

    @property
    def is_reference(self) -> bool:
        """True for the reference forward pass (no op swapped, no transform, no code)."""
        return not (self.ops or self.transforms or self.code_modules)

    def describe(self) -> str:
        """Short human text, e.g. ``attention=sdpa, mlp=fused_gate_up, torch_compile``."""
        parts = [f"{k}={v}" for k, v in self.ops]
        for t in self.transforms:
            params = ",".join(f"{k}={v}" for k, v in t.params)
            parts.append(f"{t.name}({params})" if params else t.name)
        parts += [f"code:{m.name}" for m in self.code_modules]
        return ", ".join(parts) or "reference"

    def to_proto(self) -> Any:
        """As a ``kiln.v1.Candidate`` message."""
        from kiln.v1 import common_pb2

        return common_pb2.Candidate(
            candidate_id=self.id,
            ops=dict(self.ops),
            transforms=[
                common_pb2.Transform(name=t.name, params=dict(t.params)) for t in self.transforms
            ],
            code_modules=[
                common_pb2.CodeModule(name=m.name, source=m.source) for m in self.code_modules
            ],
            lossy=self.lossy,
        )

    @staticmethod
    def from_proto(msg: Any) -> Candidate:
        """From a ``kiln.v1.Candidate`` (its candidate_id is recomputed, not trusted)."""
        return Candidate.make(
            dict(msg.ops),
            [Transform.of(t.name, **dict(t.params)) for t in msg.transforms],
            [CodeModule(m.name, m.source) for m in msg.code_modules],
            msg.lossy,
        )


def _digest(obj: dict[str, Any]) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


REFERENCE_CANDIDATE = Candidate()
"""The reference forward pass: the baseline every speedup is measured against."""
