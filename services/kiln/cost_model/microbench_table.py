"""One device's microbenchmark table: the ops measured on it, read back at any shape.

Built from the ``MicrobenchmarkMeasured`` events of one ``microbench-<kind>-<versions>`` stream
(:mod:`kiln.events.microbenchmarks`); a later measurement of the same (op, dtype, shape)
replaces an earlier one. Lookups (:mod:`kiln.cost_model.interpolate`), ms:

- ``gemm(m, n, k)``: over m for a measured (n, k); another (n, k) is read off the measured one
  nearest in ``n x k`` and scaled by the ratio (``scaled``).
- ``attention_decode(batch, context, heads, kv_heads, head_dim)``: bilinear over the measured
  batch x context grid of that head layout.
- ``attention_prefill(tokens, ...)``, ``expert(tokens, hidden, intermediate)``: over tokens.
- ``launch(graph)``: the fixed cost of one kernel (CUDA-graph replay when measured, else eager).

``None`` where nothing of the kind was measured: the caller falls back to the roofline with
the table's measured efficiencies (:meth:`MicrobenchTable.efficiency`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiln.cost_model.interpolate import Lookup, interp_1d, interp_2d
from kiln.workloads.config import DTYPE_BYTES


@dataclass
class MicrobenchTable:
    """Measured ops of one (device kind, device name, software versions)."""

    stream_id: str
    device_kind: str
    device_name: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    events: int = 0
    points: dict[tuple[str, str, tuple[tuple[str, int], ...]], float] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    _rows_by: dict[tuple[str, str], list[tuple[dict[str, int], float]]] = field(
        default_factory=dict, repr=False, compare=False
    )
    _memo: dict[tuple[Any, ...], Lookup | None] = field(
        default_factory=dict, repr=False, compare=False
    )

    def snapshot(self) -> MicrobenchTable:
        """A copy that later events do not change (for a planner thread to read)."""
        return MicrobenchTable(
            self.stream_id,
            self.device_kind,
            self.device_name,
            dict(self.versions),
            self.events,
            dict(self.points),
            dict(self.skipped),
        )

    def add_event(self, payload: Mapping[str, Any]) -> None:
        """Fold one ``MicrobenchmarkMeasured`` payload (later points replace earlier ones)."""
        self.device_name = str(payload.get("device_name", self.device_name))
        self.versions = dict(payload.get("versions") or self.versions)
        self.events += 1
        self._rows_by.clear()
        self._memo.clear()
        for r in payload.get("results") or ():
            key = (str(r["op"]), str(r["dtype"]), tuple(sorted(r["shape"].items())))
            self.points[key] = float(r["ms"])
        for s in payload.get("skipped") or ():
            self.skipped[f"{s['op']} {s.get('dtype', '')}".strip()] = str(s["reason"])

    def label(self) -> str:
        """``<kind> (<device name>; torch X, triton Y, cuda Z)``."""
        v = ", ".join(
            f"{k} {self.versions[k] or '-'}"
            for k in ("torch", "triton", "cuda")
            if k in self.versions
        )
        return f"{self.device_kind} ({self.device_name}; {v})"

    def _rows(self, op: str, dtype: str) -> Iterable[tuple[dict[str, int], float]]:
        if not self._rows_by:
            for (o, d, shape), ms in self.points.items():
                self._rows_by.setdefault((o, d), []).append((dict(shape), ms))
        return self._rows_by.get((op, dtype), ())

    def has(self, op: str, dtype: str | None = None) -> bool:
        """Whether any point of ``op`` (in ``dtype``) was measured."""
        return any(o == op and (dtype is None or d == dtype) for o, d, _ in self.points)

    # ------------------------------------------------------------------ lookups
    def gemm(self, m: int, n: int, k: int, dtype: str) -> Lookup | None:
        """``x[m, k] @ w[k, n]`` in ms (see the module docs); memoised until the next event."""
        key = ("gemm", m, n, k, dtype)
        if key not in self._memo:
            self._memo[key] = self._gemm(m, n, k, dtype)
        return self._memo[key]

    def _gemm(self, m: int, n: int, k: int, dtype: str) -> Lookup | None:
        by_nk: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        for s, ms in self._rows("gemm", dtype):
            by_nk[(s["n"], s["k"])][s["m"]] = ms
        if not by_nk:
            return None
        if (n, k) in by_nk:
            return _over(by_nk[(n, k)], m)
        near = min(by_nk, key=lambda nk: abs(math.log(nk[0] * nk[1] / (n * k))))
        return _over(by_nk[near], m).scaled(n * k / (near[0] * near[1]), "scaled")

    def attention_decode(
        self, batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: str
    ) -> Lookup | None:
        """One decode step's attention of ``batch`` sequences over ``context`` tokens, ms."""
        key = ("attention_decode", batch, context, heads, kv_heads, head_dim, dtype)
        if key not in self._memo:
            self._memo[key] = self._attention_decode(
                batch, context, heads, kv_heads, head_dim, dtype
            )
        return self._memo[key]

    def _attention_decode(
        self, batch: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype: str
    ) -> Lookup | None:
        grid: dict[tuple[float, float], float] = {}
        for s, ms in self._rows("attention_decode", dtype):
            if (s["heads"], s["kv_heads"], s["head_dim"]) == (heads, kv_heads, head_dim):
                grid[(float(s["batch"]), float(s["context"]))] = ms
        if not grid:
            return None
        xs = sorted({b for b, _ in grid})
        ys = sorted({c for _, c in grid})
        return interp_2d(xs, ys, grid, float(batch), float(context))

    def attention_prefill(
        self, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: str
    ) -> Lookup | None:
        """Causal attention of one ``tokens``-token prompt, ms (time grows as tokens squared
        beyond the largest measured prompt)."""
        pts = {
            s["tokens"]: ms
            for s, ms in self._rows("attention_prefill", dtype)
            if (s["heads"], s["kv_heads"], s["head_dim"]) == (heads, kv_heads, head_dim)
        }
        if not pts:
            return None
        top = max(pts)
        if tokens > top:  # quadratic in the prompt beyond the table
            return Lookup(pts[top] * (tokens / top) ** 2, "extrapolated")
        return _over(pts, tokens)

    def expert(self, tokens: float, hidden: int, intermediate: int, dtype: str) -> Lookup | None:
        """One routed expert's gate/up + down over ``tokens`` tokens, ms; another shape is
        scaled by ``hidden x intermediate``."""
        by: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        for s, ms in self._rows("moe_expert", dtype):
            by[(s["hidden"], s["intermediate"])][s["tokens"]] = ms
        if not by:
            return None
        t = max(1.0, tokens)
        if (hidden, intermediate) in by:
            return _over(by[(hidden, intermediate)], t)
        near = min(by, key=lambda hi: abs(math.log(hi[0] * hi[1] / (hidden * intermediate))))
        return _over(by[near], t).scaled(hidden * intermediate / (near[0] * near[1]), "scaled")

    def launch(self, graph: bool) -> Lookup | None:
        """Fixed cost of one kernel, ms: graph replay when asked for and measured, else
        eager."""
        for g in (1, 0) if graph else (0,):
            ms = self.points.get(("launch", "none", (("graph", g),)))
            if ms is not None:
                return Lookup(ms, "measured")
        return None

    def efficiency(self, dtype: str, bandwidth: float, flops: float) -> tuple[float, float]:
        """(bandwidth, compute) efficiency of the measured GEMMs against ``bandwidth`` bytes/s
        and ``flops`` FLOP/s: the median over GEMMs of m <= 8 of achieved weight bytes/s over
        ``bandwidth``, and the best achieved FLOP/s of m >= 64 over ``flops``, each capped at 1;
        1.0 where none was measured."""
        wb = DTYPE_BYTES.get(dtype, 2)
        bw, fl = [], []
        for s, ms in self._rows("gemm", dtype):
            if s["m"] <= 8:
                bw.append(s["n"] * s["k"] * wb / (ms / 1e3) / bandwidth)
            if s["m"] >= 64:
                fl.append(2 * s["m"] * s["n"] * s["k"] / (ms / 1e3) / flops)
        return (
            min(1.0, statistics.median(bw)) if bw else 1.0,
            min(1.0, max(fl)) if fl else 1.0,
        )


def _over(points: Mapping[int, float] | Mapping[float, float], x: float) -> Lookup:
    xs = sorted(points)
    return interp_1d([float(v) for v in xs], [points[v] for v in xs], float(x))  # type: ignore[index]
