"""Readers for Alibaba ServeGen's public formats (github.com/alibaba/ServeGen, read at f891d11).

- **Request JSONL** (``servegen_requests_jsonl``): one object a line, the ``Request`` record that
  ``servegen/construct.py``'s ``generate_workload`` returns, as ``dataclasses.asdict`` gives it:
  ``{"request_id": 0, "timestamp": 12.5, "data": {...}}``, ``timestamp`` in seconds from the
  start of the generated span. ``data``: ``input_tokens`` and ``output_tokens`` (language and
  reasoning; ``reason_ratio`` is ignored), or multimodal ``text_tokens``, ``output_tokens`` and
  per-item lists ``image_tokens``/``audio_tokens``/``video_tokens`` (ISL = text + every item).
  ServeGen writes no file itself: this is its request record, one a line.
- **Per-client files** (``servegen_client``): ``chunk-<id>-trace.csv`` and
  ``chunk-<id>-dataset.json`` as ``servegen/clientpool.py`` (``ClientPool._load_data``) reads
  them from ``data/<category>/<model>/``. The CSV has no header; a row is one window
  ``start_s,rate,cv,pattern,shape,scale`` (``pattern`` Gamma or Weibull; empty: the client is
  idle). The JSON maps a window start (seconds, as text) to fields, each a Python dict literal
  ``{value: probability}`` (read with :func:`ast.literal_eval`, never evaluated); a window with
  an empty distribution is skipped, as ServeGen skips it.

The request JSONL follows the row policy of :mod:`kiln.workloads.traffic.readers` (negative
times, rows before the first row and 0 input tokens are malformed rows; 0 output kept, counted).

A client's files hold distributions, not requests, so :func:`read_servegen_client` draws a
request stream from them with a seeded generator (same files and seed, same trace), as
``generate_workload`` does for one client at its own rate: each window lasts until the next one
starts (the last as long as the one before; 600 s if alone), holds ``round(rate x length)``
arrivals whose gaps come from the window's pattern scaled to fill it, and uses the latest length
distributions at or before its start. One uniform draw per request sets every length field, as
``_sample_data_batch`` does (so ISL and OSL quantiles move together); each multimodal item draws
its own. Drawn requests with 0 input tokens are dropped and reported in ``problems`` per window
(``trace_rows_skipped``); more than ``max_requests`` requests is a TraceError (read a span).
"""

from __future__ import annotations

import ast
import bisect
import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from kiln.workloads.traffic.readers import (
    DEFAULT_MAX_BAD_FRACTION,
    DEFAULT_MAX_BAD_ROWS,
    RowError,
    TraceError,
    arrival_parts,
    check_problems,
    finish,
    json_count,
    nonzero_input,
    open_trace,
    timed_json_row,
    warn_zero_output,
)
from kiln.workloads.traffic.records import Request, RowProblem, Trace

log = structlog.get_logger(__name__)

SERVEGEN_REQUESTS_FORMAT = "servegen_requests_jsonl"
SERVEGEN_CLIENT_FORMAT = "servegen_client"
PATTERNS = ("Gamma", "Weibull")
DEFAULT_WINDOW_S = 600.0
DEFAULT_MAX_REQUESTS = 1_000_000
MEDIA = ("image", "audio", "video")
_CLIENT_NAME = re.compile(r"(?P<stem>.+)-(?:trace\.csv|dataset\.json)")
_CHUNK_NAME = re.compile(r"chunk-\d+-(?:trace\.csv|dataset\.json)")  # as clientpool.py names them
_PMF_TOLERANCE = 1e-6  # clientpool.py's Client.validate: a PDF sums to 1 within 1e-6


# ---------------------------------------------------------------------------- recognising
def is_client_file(path: Path) -> bool:
    """Whether ``path`` is named as ServeGen names a client's files (``chunk-<id>-trace.csv``,
    ``chunk-<id>-dataset.json``) and is not a directory.
    """
    return _CHUNK_NAME.fullmatch(path.name) is not None and not path.is_dir()


def is_request_line(line: str) -> bool:
    """Whether a trace's first line is a ServeGen request object (``timestamp`` and ``data``)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return False
    return isinstance(obj, dict) and "timestamp" in obj and isinstance(obj.get("data"), dict)


def is_window_line(line: str) -> bool:
    """Whether a line reads as a ServeGen window row ``start,rate,cv,pattern,shape,scale``."""
    fields = line.split(",")
    if len(fields) != 6 or fields[3].strip() not in ("", *PATTERNS):
        return False
    try:
        int(fields[0])
        for f in (fields[1], fields[2], fields[4], fields[5]):
            float(f)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------- request JSONL
def read_servegen_requests(
    path: str | Path,
    *,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Read ServeGen requests, one JSON object a line (other keys ignored); TraceError: no
    requests or too many malformed rows.
    """
    p = Path(path)
    rows: list[tuple[int, float, int, int, tuple[int, ...], int]] = []
    problems: list[RowProblem] = []
    with open_trace(p) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                whole, frac, isl, osl = _request_row(text)
                rows.append((whole, frac, isl, osl, (), line))
            except RowError as exc:
                problems.append(RowProblem(line, str(exc)))
                if len(problems) > max_bad_rows:
                    break
    return finish(p, SERVEGEN_REQUESTS_FORMAT, rows, problems, max_bad_fraction, max_bad_rows)


def _request_row(text: str) -> tuple[int, float, int, int]:
    obj, t = timed_json_row(text, "seconds", "the span's start")
    data = obj.get("data")
    if not isinstance(data, dict):
        raise RowError("missing object 'data'")
    if "input_tokens" in data:
        isl = json_count(data, "input_tokens")
    elif "text_tokens" in data:
        isl = json_count(data, "text_tokens")
        for medium in MEDIA:
            items = data.get(f"{medium}_tokens", [])
            if not isinstance(items, list):
                raise RowError(f"{medium}_tokens must be a list of token counts")
            item = f"{medium}_tokens item"
            isl += sum(json_count({item: n}, item) for n in items)
    else:
        raise RowError("data has neither 'input_tokens' nor 'text_tokens'")
    isl = nonzero_input(isl, "input tokens")
    osl = json_count(data, "output_tokens")
    whole, frac = arrival_parts(t)
    return whole, frac, isl, osl


# ---------------------------------------------------------------------------- client files
@dataclass(frozen=True)
class _Window:
    start: int
    rate: float
    pattern: str
    shape: float
    scale: float
    line: int


_Pmf = tuple[list[int], list[float]]  # values ascending, cumulative probabilities


def client_files(path: str | Path) -> tuple[Path, Path]:
    """(``<stem>-trace.csv``, ``<stem>-dataset.json``) of the client ``path`` names (either)."""
    p = Path(path)
    m = _CLIENT_NAME.fullmatch(p.name)
    if m is None:
        raise TraceError(
            f"{p}: a ServeGen client is read from <stem>-trace.csv beside <stem>-dataset.json", p
        )
    stem = m.group("stem")
    return p.with_name(f"{stem}-trace.csv"), p.with_name(f"{stem}-dataset.json")


def read_servegen_client(
    path: str | Path,
    *,
    start_s: float = 0.0,
    end_s: float = math.inf,
    seed: int = 0,
    max_requests: int = DEFAULT_MAX_REQUESTS,
    max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION,
    max_bad_rows: int = DEFAULT_MAX_BAD_ROWS,
) -> Trace:
    """Requests drawn from one ServeGen client's windows in ``[start_s, end_s)`` (seconds of its
    timeline; ``path`` either of its two files). TraceError: a file missing or malformed, too
    many malformed windows, more than ``max_requests`` requests, no requests.
    """
    trace_csv, dataset_json = client_files(path)
    for f in (trace_csv, dataset_json):
        if not f.exists():
            raise TraceError(f"{f}: missing (a ServeGen client needs both of its files)", f)
    windows, problems, total, stopped = _read_windows(trace_csv, max_bad_rows)
    dists = _read_dataset(dataset_json)
    starts = sorted(dists)
    plan: list[tuple[_Window, float, float, int, dict[str, _Pmf]]] = []
    for i, w in enumerate(windows):
        if w.pattern == "" or w.rate == 0:
            continue
        end = windows[i + 1].start if i + 1 < len(windows) else w.start + _last_length(windows)
        lo, hi = max(float(w.start), start_s), min(float(end), end_s)
        k = bisect.bisect_right(starts, w.start) - 1
        if hi <= lo:
            continue
        if k < 0:
            problems.append(RowProblem(w.line, f"no length distribution in {dataset_json.name}"))
            continue
        plan.append((w, lo, hi, round(w.rate * (hi - lo)), dists[starts[k]]))
    problems.sort(key=lambda p: p.line)
    check_problems(trace_csv, problems, total, max_bad_fraction, max_bad_rows, stopped=stopped)
    wanted = sum(n for *_, n, _ in plan)
    if wanted > max_requests:
        raise TraceError(
            f"{trace_csv}: its windows in [{start_s:g}, {end_s:g}) s give {wanted:,} requests, "
            f"more than {max_requests:,}; read a shorter span (read_servegen_client's start_s, "
            "end_s)",
            trace_csv,
        )
    rng = random.Random(seed)
    drawn: list[tuple[float, int, int, int]] = []
    dropped: list[RowProblem] = []
    for w, lo, hi, n, dist in plan:
        zero = 0
        for t in _arrivals(rng, w, lo, hi, n):
            isl, osl = _lengths(rng, dist)
            if isl == 0:
                zero += 1
            else:
                drawn.append((t, isl, osl, w.line))
        if zero:
            dropped.append(
                RowProblem(w.line, f"{zero} of {n} drawn requests had 0 input tokens; dropped")
            )
    if dropped:
        log.warning(
            "trace_rows_skipped",
            file=str(trace_csv),
            skipped=wanted - len(drawn),
            rows=wanted,
            first=[f"{trace_csv}:{p.line}: {p.reason}" for p in dropped[:5]],
        )
    if not drawn:
        raise TraceError(f"{trace_csv}: no requests in [{start_s:g}, {end_s:g}) s", trace_csv)
    drawn.sort(key=lambda r: r[0])
    zero_output = warn_zero_output(trace_csv, [r[3] for r in drawn if r[2] == 0], len(drawn))
    origin = drawn[0][0]
    requests = tuple(Request(t - origin, isl, osl) for t, isl, osl, _ in drawn)
    log.info("servegen_client_drawn", file=str(trace_csv), requests=len(requests), seed=seed)
    problems = sorted(problems + dropped, key=lambda p: p.line)
    return Trace(trace_csv, SERVEGEN_CLIENT_FORMAT, requests, tuple(problems), 0, zero_output)


def _last_length(windows: list[_Window]) -> float:
    if len(windows) < 2:
        return DEFAULT_WINDOW_S
    return float(windows[-1].start - windows[-2].start)


def _read_windows(
    path: Path, max_bad_rows: int
) -> tuple[list[_Window], list[RowProblem], int, bool]:
    """(windows in time order, malformed rows, rows read, whether reading stopped early)."""
    windows: list[_Window] = []
    problems: list[RowProblem] = []
    total = 0
    with open_trace(path) as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            total += 1
            try:
                w = _window(text.strip(), line)
                if windows and w.start <= windows[-1].start:
                    raise RowError(
                        f"window start {w.start} s not after the previous one "
                        f"({windows[-1].start} s, line {windows[-1].line})"
                    )
                windows.append(w)
            except RowError as exc:
                problems.append(RowProblem(line, str(exc)))
                if len(problems) > max_bad_rows:
                    return windows, problems, total, True
    return windows, problems, total, False


def _window(text: str, line: int) -> _Window:
    fields = [f.strip() for f in text.split(",")]
    if len(fields) != 6:
        raise RowError(f"expected 6 fields (start,rate,cv,pattern,shape,scale), got {len(fields)}")
    try:
        start = int(fields[0])
        rate, shape, scale = float(fields[1]), float(fields[4]), float(fields[5])
    except ValueError:
        raise RowError(f"bad number in {text[:80]!r}") from None
    pattern = fields[3]
    if start < 0:
        raise RowError(f"negative window start {start}")
    if not math.isfinite(rate) or rate < 0:
        raise RowError(f"rate must be a finite number >= 0, got {fields[1]}")
    if pattern not in ("", *PATTERNS):
        raise RowError(f"unknown arrival pattern {pattern!r} (expected Gamma or Weibull)")
    if pattern and not (shape > 0 and scale > 0 and math.isfinite(shape * scale)):
        raise RowError(f"{pattern} needs shape and scale > 0, got {fields[4]}, {fields[5]}")
    return _Window(start, rate, pattern, shape, scale, line)


def _read_dataset(path: Path) -> dict[int, dict[str, _Pmf]]:
    """Window start -> field -> distribution; windows with an empty distribution left out."""
    with open_trace(path) as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg})", path) from None
    if not isinstance(raw, dict):
        raise TraceError(f"{path}: expected an object of windows", path)
    out: dict[int, dict[str, _Pmf]] = {}
    for key, fields in raw.items():
        try:
            start = int(key)
            if not isinstance(fields, dict):
                raise ValueError("expected an object of fields")
            tables = {name: _table(name, text) for name, text in fields.items()}
            if not tables or not all(tables.values()):
                continue  # an empty distribution: ServeGen skips the window
            pmfs = {n: _pmf(n, t) for n, t in tables.items() if n != "reason_ratio"}
            if "output_tokens" not in pmfs:
                raise ValueError("no output_tokens distribution")
            if "input_tokens" not in pmfs and "text_tokens" not in pmfs:
                raise ValueError("neither an input_tokens nor a text_tokens distribution")
        except ValueError as exc:
            raise TraceError(f"{path}: window {key!r}: {exc}", path) from None
        out[start] = pmfs
    return out


def _table(name: str, text: object) -> dict[Any, Any]:
    """A field's dict literal, read with :func:`ast.literal_eval`."""
    if not isinstance(text, str):
        raise ValueError(f"{name}: expected a dict literal in a string")
    try:
        table = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"{name}: not a dict literal") from None
    if not isinstance(table, dict):
        raise ValueError(f"{name}: not a dict literal")
    return table


def _pmf(name: str, table: dict[Any, Any]) -> _Pmf:
    """Values ascending and their cumulative probabilities; ValueError unless the values are
    token counts and the probabilities sum to 1.
    """
    if not all(type(v) is int and v >= 0 for v in table):
        raise ValueError(f"{name}: values must be integers >= 0")
    values = sorted(table)
    probs = [table[v] for v in values]
    if not all(type(q) in (int, float) and math.isfinite(q) and q >= 0 for q in probs):
        raise ValueError(f"{name}: probabilities must be finite numbers >= 0")
    total = math.fsum(probs)
    if abs(total - 1.0) > _PMF_TOLERANCE:
        raise ValueError(f"{name}: probabilities sum to {total:.9g}, not 1")
    cumulative, acc = [], 0.0
    for q in probs:
        acc += q / total
        cumulative.append(acc)
    return values, cumulative


def _draw(pmf: _Pmf, u: float) -> int:
    values, cumulative = pmf
    return values[min(bisect.bisect_left(cumulative, u), len(values) - 1)]


def _lengths(rng: random.Random, dist: dict[str, _Pmf]) -> tuple[int, int]:
    u = rng.random()
    osl = _draw(dist["output_tokens"], u)
    if "input_tokens" in dist:
        return _draw(dist["input_tokens"], u), osl
    isl = _draw(dist["text_tokens"], u)
    for medium in MEDIA:
        count, tokens = dist.get(f"{medium}_count"), dist.get(f"{medium}_tokens")
        if count is not None and tokens is not None:
            isl += sum(_draw(tokens, rng.random()) for _ in range(_draw(count, u)))
    return isl, osl


def _arrivals(rng: random.Random, w: _Window, lo: float, hi: float, n: int) -> list[float]:
    """``n`` arrivals in ``[lo, hi)`` whose gaps follow the window's pattern, scaled to fill it."""
    if w.pattern == "Gamma":
        gaps = [rng.gammavariate(w.shape, w.scale) for _ in range(n + 1)]
    else:
        gaps = [rng.weibullvariate(w.scale, w.shape) for _ in range(n + 1)]
    total = math.fsum(gaps)
    if not (total > 0 and math.isfinite(total)):
        gaps, total = [1.0] * (n + 1), float(n + 1)
    out, acc = [], 0.0
    for g in gaps[:n]:
        acc += g
        out.append(lo + (hi - lo) * acc / total)
    return out
