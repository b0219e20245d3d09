"""Traffic windows: requests folded by arrival time into fixed-length windows (trace time, seconds).

Window ``k`` covers arrivals in ``[origin_s + k * step_s, origin_s + k * step_s + length_s)``;
``step_s == length_s`` gives tumbling windows, ``step_s < length_s`` sliding (overlapping) ones,
so a request lies in ``ceil(length_s / step_s)`` windows or fewer. A window closes when the
*watermark* (the latest arrival seen) reaches its end plus ``lateness_s``; nothing depends on the
wall clock, so a replay at any ``--speed`` (or a restart that re-adds the records) gives the same
windows. A window's requests are kept sorted by ``(arrival_s, isl, osl, hash_ids)``, so the
records of a window may arrive in any order before it closes and give the same window.

A record that arrives after every window containing it has closed is *late*: it is dropped and
counted (:attr:`WindowFolder.late`), as is one before ``origin_s``. Windows without any request
are not emitted (their indices are skipped: a gap in traffic); windows with fewer than
``min_requests`` are emitted with ``sparse=True`` (the drift detector never counts them).
Stdlib only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.domain.operating_point import DEFAULT_MAX_BATCH
from kiln.workloads.traffic.records import Request
from kiln.workloads.traffic.shape import TrafficShape


def _order(r: Request) -> tuple[float, int, int, tuple[int, ...]]:
    """A total order of records, so a window's contents do not depend on their arrival order."""
    return (r.arrival_s, r.isl, r.osl, r.hash_ids)


@dataclass(frozen=True)
class WindowSpec:
    """How records are cut into windows (seconds of arrival time).

    Attributes:
        length_s: window length.
        step_s: between window starts (``== length_s``: tumbling; ``< length_s``: sliding).
        min_requests: a window with fewer requests is closed but marked sparse.
        lateness_s: a window closes once a record at or after ``end_s + lateness_s`` arrives
            (0: as soon as one at or after ``end_s`` does); records may arrive out of order by
            up to this much and still land in their windows. At most ``length_s``.

    Raises:
        ValueError: a value outside ``0 < step_s <= length_s``, ``min_requests >= 1``,
            ``0 <= lateness_s <= length_s`` or not finite.
    """

    length_s: float = 600.0
    step_s: float = 300.0
    min_requests: int = 50
    lateness_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("length_s", "step_s", "lateness_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"window {name} must be a number of seconds, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"window {name} must be finite, got {value!r}")
        if not 0 < self.step_s <= self.length_s:
            raise ValueError(
                f"window step_s must be within 0 < step_s <= length_s = {self.length_s:g}, "
                f"got {self.step_s:g}"
            )
        if isinstance(self.min_requests, bool) or not isinstance(self.min_requests, int):
            raise ValueError(f"window min_requests must be an integer, got {self.min_requests!r}")
        if self.min_requests < 1:
            raise ValueError(f"window min_requests must be >= 1, got {self.min_requests}")
        if not 0 <= self.lateness_s <= self.length_s:
            raise ValueError(
                f"window lateness_s must be within 0..length_s = {self.length_s:g}, "
                f"got {self.lateness_s:g}"
            )

    @property
    def tumbling(self) -> bool:
        """Whether windows do not overlap (``step_s == length_s``)."""
        return self.step_s == self.length_s


@dataclass(frozen=True)
class TrafficWindow:
    """One closed window.

    Attributes:
        index: 0, 1, ... counted in steps from ``origin_s`` (the first record's window is 0).
        start_s, end_s: arrival-time bounds ``[start_s, end_s)`` (seconds, trace time).
        requests: its records, sorted by ``(arrival_s, isl, osl, hash_ids)``.
        sparse: fewer than ``spec.min_requests`` requests.
    """

    index: int
    start_s: float
    end_s: float
    requests: tuple[Request, ...]
    sparse: bool

    def shape(self, *, max_batch: int = DEFAULT_MAX_BATCH) -> TrafficShape:
        """The window's traffic shape, ``source="window <index>"``; ValueError if empty."""
        return TrafficShape.from_requests(
            self.requests, source=f"window {self.index}", max_batch=max_batch
        )


class WindowFolder:
    """Folds records (any arrival order within ``spec.lateness_s``; within one window when that
    is 0 and windows tumble) into windows by arrival time; windows are closed by time, never by
    wall clock, so a replay at any ``--speed`` gives the same windows.

    State survives a restart by re-adding the records of open windows (:meth:`open_requests`,
    kept by the caller) to a folder made with the same spec, ``origin_s`` and ``closed_before``
    (:attr:`next_index`): the same windows then close at the same records.
    """

    def __init__(
        self, spec: WindowSpec, origin_s: float | None = None, *, closed_before: int = 0
    ) -> None:
        """``origin_s``: start of window 0 (default: the first record's ``arrival_s``);
        ``closed_before``: windows below this index count as already closed (a restart).

        Raises:
            ValueError: ``origin_s`` not finite, ``closed_before < 0``.
        """
        if origin_s is not None and not math.isfinite(origin_s):
            raise ValueError(f"origin_s must be finite, got {origin_s!r}")
        if closed_before < 0:
            raise ValueError(f"closed_before must be >= 0, got {closed_before}")
        self.spec = spec
        self.origin_s = origin_s
        self.watermark_s: float | None = None
        self.late = 0
        self._next = closed_before  # every window below this index is closed
        self._open: dict[int, list[Request]] = {}

    # ------------------------------------------------------------------ geometry
    def start_of(self, index: int) -> float:
        """Start of window ``index`` (seconds); ValueError before the first record."""
        if self.origin_s is None:
            raise ValueError("no origin yet: add a record or give origin_s")
        return self.origin_s + index * self.spec.step_s

    def end_of(self, index: int) -> float:
        """End (exclusive) of window ``index`` (seconds)."""
        return self.start_of(index) + self.spec.length_s

    def _containing(self, t: float) -> range:
        """Indices of the windows containing arrival ``t`` (``t >= origin_s``)."""
        assert self.origin_s is not None
        step, length = self.spec.step_s, self.spec.length_s
        hi = math.floor((t - self.origin_s) / step)
        while hi > 0 and self.start_of(hi) > t:
            hi -= 1
        while self.start_of(hi + 1) <= t:
            hi += 1
        lo = max(0, math.floor((t - self.origin_s - length) / step))
        while lo <= hi and self.end_of(lo) <= t:
            lo += 1
        while lo > 0 and self.end_of(lo - 1) > t:
            lo -= 1
        return range(lo, hi + 1)

    def _closable(self, watermark: float) -> int:
        """One past the highest index whose end + lateness is at or before ``watermark``."""
        assert self.origin_s is not None
        spec = self.spec
        k = math.floor((watermark - self.origin_s - spec.length_s - spec.lateness_s) / spec.step_s)
        k = max(k, -1)
        while k >= 0 and self.end_of(k) + spec.lateness_s > watermark:
            k -= 1
        while self.end_of(k + 1) + spec.lateness_s <= watermark:
            k += 1
        return k + 1

    # ------------------------------------------------------------------ folding
    def add(self, request: Request) -> list[TrafficWindow]:
        """Fold one record in; the windows it closes (watermark >= their ``end_s + lateness_s``;
        ``end_s`` when lateness is 0), oldest first. A late record is counted and dropped."""
        t = request.arrival_s
        if self.origin_s is None:
            self.origin_s = t
        if t < self.origin_s:
            self.late += 1
            return []
        kept = False
        for k in self._containing(t):
            if k >= self._next:
                self._open.setdefault(k, []).append(request)
                kept = True
        if not kept:
            self.late += 1
        if self.watermark_s is None or t > self.watermark_s:
            self.watermark_s = t
        return self._close_until(self._closable(self.watermark_s))

    def flush(self) -> list[TrafficWindow]:
        """Close every open window (the end of a file), oldest first; later records for them
        are late."""
        if not self._open:
            return []
        return self._close_until(max(self._open) + 1)

    def _close_until(self, stop: int) -> list[TrafficWindow]:
        if stop <= self._next:
            return []
        closed = [self._window(k, self._open.pop(k)) for k in sorted(self._open) if k < stop]
        self._next = stop
        return closed

    def _window(self, index: int, requests: list[Request]) -> TrafficWindow:
        requests.sort(key=_order)
        return TrafficWindow(
            index=index,
            start_s=self.start_of(index),
            end_s=self.end_of(index),
            requests=tuple(requests),
            sparse=len(requests) < self.spec.min_requests,
        )

    def open_requests(self) -> list[Request]:
        """The distinct records held by open windows, in ``(arrival_s, ...)`` order: what a caller
        keeps to rebuild this folder after a restart (re-add them to a fresh folder with the
        same spec and ``origin_s``)."""
        seen: dict[int, Request] = {}
        for records in self._open.values():
            for r in records:
                seen.setdefault(id(r), r)
        return sorted(seen.values(), key=_order)

    @property
    def next_index(self) -> int:
        """Every window below this index is closed."""
        return self._next


def fold(
    requests: list[Request] | tuple[Request, ...], spec: WindowSpec, origin_s: float | None = None
) -> list[TrafficWindow]:
    """All windows of ``requests`` (a file): each added in the given order, then flushed."""
    folder = WindowFolder(spec, origin_s)
    out: list[TrafficWindow] = []
    for r in requests:
        out += folder.add(r)
    return out + folder.flush()
