"""One row of ``benchmarks/results/h200_dense.json`` (issue 10) from a finished compilation.

Reads the compilation's events from the running kiln's ledger, folds them as ``kiln compile``
and ``kiln compilations show`` do (:class:`kiln.agent_runner.snapshot.Snapshot` for the
compilation, :class:`kiln.baselines.table.Comparison` for the side-by-side table), and appends
one row to a JSON list (created when missing; a row of the same model, batch, context and trace
is replaced). A row's keys:

- ``model``: the submitted model's name; ``trace``: the trace it was compiled for (given).
- ``batch``, ``context``: the operating point measured at (sequences, tokens in each KV cache;
  the engine's, which may have lowered the traffic's to fit the device).
- ``reference``, ``hf_compile``, ``gpt_fast``, ``kiln_best``: decode tokens/s on the full tier
  (the whole model): kiln's reference forward, the two baselines (null when skipped or failed)
  and kiln's confirmed best (the reference's when no candidate beat it); null where the full
  tier measured none (a fast-tier figure holds fewer layers and is not comparable).
- ``prefill_ms``: ``{reference, hf_compile, gpt_fast, kiln_best}`` -> the median of the
  full-tier engine's timed prefills of batch x context prompt tokens, ms (null where not timed:
  the engine's ``prefill_repeats`` was 0, the baseline did not run, or the events predate it;
  ``kiln_best`` is the reference's when no candidate beat it); ``prefill_check``: kiln best's
  prefill against the reference's measured next to it
  (:meth:`kiln.baselines.table.PrefillCheck.describe`; "" when either was not timed).
- ``baseline_checks``: each baseline's check against kiln's reference (``correct (max abs error
  ...)``, ``INCORRECT (...)``, ``skipped: ...``). A bf16 baseline can be judged incorrect by
  rounding alone on deep models (benchmarks/notes/qwen3_hf_bf16.md): its tokens/s are kept.
- ``limit_tok_s``: the bandwidth limit at that point, weights plus KV cache
  (:func:`kiln.cli.compile_view.comparison_limit`); ``limit``: its description (it says
  "weights only" where the context was unknown).
- ``experiments``: experiments done; ``failures``: experiments neither ``ok`` nor ``cancelled``,
  by cause (``"<status>: <the error's first clause>"`` -> count); ``time_to_95_s``: seconds
  from submission until the best first reached 95 % of the final best (null without a best);
  ``best_candidate``: the winner in words.
- ``command``: the command line that ran the compilation (given); ``date``: when the
  compilation's last event was recorded, ISO 8601 UTC.

    python3 benchmarks/dense_row.py ID --trace azure_llm_2023_conv.csv \\
        --command "kiln compile ..." --out benchmarks/results/h200_dense.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from datetime import UTC
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.agent_runner.snapshot import WATCHED_TYPES, Snapshot
from kiln.baselines.table import Comparison
from kiln.cli.compile_view import comparison_limit, describe_candidate, time_to_95
from kiln.common.errors import KilnError, NotFound
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.domain.streams import compilation_stream
from kiln.ledger.convert import recorded_data
from kiln.v1 import common_pb2, compiler_pb2

if TYPE_CHECKING:
    from kiln.ledger.client import LedgerClient

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "h200_dense.json"
BASELINES = ("hf_compile", "gpt_fast")
"""The baselines a row reports."""
KEY = ("model", "batch", "context", "trace")
"""The fields that identify a row: a new row replaces an old one with the same values."""


def failure_cause(data: dict[str, Any]) -> str | None:
    """``"<status>: <first clause of the error>"`` of an ``ExperimentCompleted`` payload that is
    not ``ok`` (ids and numbers left in; at most 100 characters), None for ``ok``."""
    status = str(data.get("status", "")).lower()
    if status in ("ok", "cancelled", ""):
        return None
    error = str(data.get("error", "")).strip().splitlines()
    first = error[0] if error else ""
    for sep in (" (", "; ", ". "):
        first = first.split(sep, 1)[0]
    return f"{status}: {first}"[:100]


async def read_compilation(
    client: LedgerClient, compilation_id: str, failures: dict[str, int] | None = None
) -> tuple[compiler_pb2.Compilation, Comparison]:
    """The compilation folded from its events and its experiments' (ledger order, from its
    submission up to its ``CompilationEnded`` or the ledger's head), as ``Compiler.Watch``
    folds them, and the baselines' table folded from the same events. ``failures``, when
    given, counts the compilation's experiments that were not ``ok`` by :func:`failure_cause`.

    Raises:
        LookupError: no such compilation.
    """
    try:
        first = await client.read_stream(compilation_stream(compilation_id), max_count=1)
    except NotFound:
        first = []
    if not first:
        raise LookupError(f"no compilation {compilation_id!r} in the ledger at {client.addr}")
    snap = Snapshot(compilation_id)
    comparison = Comparison(REFERENCE_CANDIDATE.id)
    events = client.read_all(first[0].position - 1, types=WATCHED_TYPES)
    try:
        async for event in events:
            if not snap.belongs(event):
                continue
            snap.apply(event)
            data = recorded_data(event)
            comparison.update(event.type, data)
            if failures is not None and event.type == "ExperimentCompleted":
                if data.get("compilation_id") == compilation_id:
                    cause = failure_cause(data)
                    if cause is not None:
                        failures[cause] = failures.get(cause, 0) + 1
            if snap.ended and event.stream_id == snap.stream_id:
                break
    finally:
        aclose = getattr(events, "aclose", None)  # the stream's call is cancelled on close
        if aclose is not None:
            await aclose()
    return snap.message, comparison


def _baseline_tps(comparison: Comparison, name: str) -> float | None:
    """A baseline's tokens/s when it ran (its check's verdict is in ``baseline_checks``), else
    None."""
    d = comparison.baselines.get(name) or {}
    tps = float(d.get("tokens_per_s", 0) or 0)
    return tps if d.get("status") == "ok" and tps > 0 else None


def _baseline_checks(comparison: Comparison) -> dict[str, str]:
    """Each baseline's check against kiln's reference forward, as the table prints it
    (``correct (max abs error 0.03)``, ``INCORRECT (...)``, ``skipped: ...``)."""
    return {row.label: row.note for row in comparison.baseline_rows()}


def _ms(value: float) -> float | None:
    """A prefill median, None when not timed (0)."""
    return value if value > 0 else None


def prefill_figures(
    snap: compiler_pb2.Compilation, comparison: Comparison
) -> tuple[dict[str, float | None], str]:
    """``(prefill_ms, prefill_check)`` of the row (see the module docstring): the table's
    figures (:meth:`Comparison.reference`, :meth:`Comparison.baseline_rows`,
    :meth:`Comparison.prefill_of`), full tier only."""
    ref = comparison.reference()
    ref_ms = _ms(ref.prefill_ms) if ref is not None and ref.tier == "full" else None
    rows = {row.label: row for row in comparison.baseline_rows()}
    out = {name: _ms(rows[name].prefill_ms) if name in rows else None for name in BASELINES}
    best_id, check = snap.best.candidate.candidate_id, None
    if snap.HasField("best") and snap.best.measurement.tier == common_pb2.TIER_FULL:
        best = _ms(comparison.prefill_of(best_id))
        check = comparison.prefill_check(best_id)
    else:
        best = ref_ms
    figures = {"reference": ref_ms, **out, "kiln_best": best}
    return figures, check.describe() if check is not None else ""


def operating_point(snap: compiler_pb2.Compilation, comparison: Comparison) -> tuple[int, int]:
    """(batch, context) measured at: the best's measurement, else the baselines' engine's,
    else the traffic shape's."""
    m = snap.best.measurement
    if snap.HasField("best") and m.batch_size > 0 and m.context_len > 0:
        return m.batch_size, m.context_len
    if comparison.context() > 0:
        return comparison.batch(), comparison.context()
    traffic = snap.workload.traffic
    return int(traffic.batch_size), int(traffic.context_len)


def dense_row(
    snap: compiler_pb2.Compilation,
    comparison: Comparison,
    *,
    trace: str,
    command: str,
    failures: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The results row of a folded compilation (keys in the module docstring)."""
    batch, context = operating_point(snap, comparison)
    ref = comparison.reference()
    reference = ref.tokens_per_s if ref is not None and ref.tier == "full" else None
    if reference is None and snap.best.reference.tokens_per_s > 0:
        reference = snap.best.reference.tokens_per_s
    if snap.HasField("best") and snap.best.measurement.tier == common_pb2.TIER_FULL:
        best: float | None = snap.best.measurement.tokens_per_s
        best_candidate = describe_candidate(snap.best.candidate) or snap.best.candidate.candidate_id
    else:
        best, best_candidate = reference, "reference (no candidate beat it on the full tier)"
    limit = comparison_limit(comparison, snap)
    prefill_ms, prefill_check = prefill_figures(snap, comparison)
    to95 = time_to_95(snap)
    ended = snap.updated_at.ToDatetime(tzinfo=UTC) if snap.HasField("updated_at") else None
    return {
        "model": snap.workload.model.name,
        "batch": batch,
        "context": context,
        "trace": trace,
        "reference": reference,
        "hf_compile": _baseline_tps(comparison, "hf_compile"),
        "gpt_fast": _baseline_tps(comparison, "gpt_fast"),
        "baseline_checks": _baseline_checks(comparison),
        "kiln_best": best,
        "prefill_ms": prefill_ms,
        "prefill_check": prefill_check,
        "limit_tok_s": limit.tokens_per_s if limit else None,
        "limit": limit.describe() if limit else "unknown (no weights bytes or hardware entry)",
        "experiments": snap.experiments_done,
        "failures": dict(sorted((failures or {}).items(), key=lambda kv: -kv[1])),
        "time_to_95_s": to95,
        "best_candidate": best_candidate,
        "command": command,
        "date": ended.isoformat(timespec="seconds") if ended else "",
    }


def upsert_row(path: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """Append ``row`` to the JSON list in ``path`` (created with its directory when missing),
    replacing rows with the same :data:`KEY` values; written atomically. Returns the list.

    Raises:
        ValueError: ``path`` holds something other than a JSON list.
    """
    rows: list[dict[str, Any]] = []
    if path.exists():
        loaded = json.loads(path.read_text() or "[]")
        if not isinstance(loaded, list):
            raise ValueError(f"{path} does not hold a JSON list")
        rows = loaded
    key = tuple(row.get(k) for k in KEY)
    rows = [r for r in rows if tuple(r.get(k) for k in KEY) != key]
    rows.append(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n")
    tmp.replace(path)
    return rows


async def _row(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.cli.context import ledger_addr
    from kiln.common.settings import load_settings
    from kiln.common.tls import client_material
    from kiln.ledger.client import LedgerClient

    given = {"team": args.team, "ledger_addr": args.ledger_addr}
    settings = load_settings(**{k: v for k, v in given.items() if v is not None})
    tls = client_material(settings)  # the team's certificate (--team), not KILN_TEAM's
    async with LedgerClient(ledger_addr(settings), settings.team, tls=tls) as client:
        failures: dict[str, int] = {}
        snap, comparison = await read_compilation(client, args.compilation_id, failures)
    trace = args.trace or Path(snap.workload.traffic.source).name
    return dense_row(snap, comparison, trace=trace, command=args.command, failures=failures)


def main(argv: list[str] | None = None) -> int:
    """Write the row; print it. Returns 0, or 1 when the compilation cannot be read."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("compilation_id")
    p.add_argument("--trace", default="", help="trace name (default: the traffic's source)")
    p.add_argument("--command", default="", help="the command line that ran the compilation")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON list to update")
    p.add_argument("--ledger-addr", default=None, help="default: the running kiln's")
    p.add_argument("--team", default=None, help="default: KILN_TEAM")
    args = p.parse_args(argv)
    try:
        row = asyncio.run(_row(args))
    except (LookupError, KilnError) as exc:
        print(f"dense_row: {exc}", file=sys.stderr)
        return 1
    rows = upsert_row(args.out, row)
    print(json.dumps(row, indent=2))
    print(f"{args.out}: {len(rows)} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
