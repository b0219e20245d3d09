"""Traffic windows: tumbling and sliding folding, lateness, flush, order independence, restart."""

from __future__ import annotations

import random

import pytest

from kiln.workloads.traffic.records import Request
from kiln.workloads.traffic.windows import TrafficWindow, WindowFolder, WindowSpec, fold


def _reqs(times: list[float]) -> list[Request]:
    return [Request(t, 100 + i, 10) for i, t in enumerate(times)]


def _bounds(ws: list[TrafficWindow]) -> list[tuple[int, float, float, int]]:
    return [(w.index, w.start_s, w.end_s, len(w.requests)) for w in ws]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"step_s": 0.0}, "step_s"),
        ({"length_s": 10.0, "step_s": 20.0}, "step_s"),
        ({"min_requests": 0}, "min_requests"),
        ({"lateness_s": -1.0}, "lateness_s"),
        ({"length_s": 10.0, "step_s": 10.0, "lateness_s": 11.0}, "lateness_s"),
        ({"length_s": float("inf")}, "finite"),
    ],
)
def test_spec_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WindowSpec(**kwargs)


def test_tumbling_windows_close_when_a_record_reaches_their_end() -> None:
    folder = WindowFolder(WindowSpec(length_s=10.0, step_s=10.0, min_requests=2))
    assert folder.add(Request(0.0, 1, 1)) == []
    assert folder.add(Request(9.99, 1, 1)) == []
    closed = folder.add(Request(10.0, 1, 1))  # arrival_s >= end_s closes window 0
    assert _bounds(closed) == [(0, 0.0, 10.0, 2)]
    assert not closed[0].sparse
    # a gap: window 1 closes with one record (sparse), empty windows 2..3 are skipped
    closed = folder.add(Request(45.0, 1, 1))
    assert _bounds(closed) == [(1, 10.0, 20.0, 1)]
    assert closed[0].sparse
    assert _bounds(folder.flush()) == [(4, 40.0, 50.0, 1)]
    assert folder.flush() == []


def test_sliding_windows_hold_each_record_in_every_window_covering_it() -> None:
    ws = fold(_reqs([0.0, 4.0, 6.0, 11.0, 14.0]), WindowSpec(length_s=10.0, step_s=5.0))
    assert _bounds(ws) == [(0, 0.0, 10.0, 3), (1, 5.0, 15.0, 3), (2, 10.0, 20.0, 2)]
    assert [r.arrival_s for r in ws[1].requests] == [6.0, 11.0, 14.0]


def test_origin_and_late_records() -> None:
    folder = WindowFolder(WindowSpec(length_s=10.0, step_s=10.0), origin_s=100.0)
    assert folder.add(Request(99.0, 1, 1)) == []  # before the origin: late
    folder.add(Request(105.0, 1, 1))
    folder.add(Request(121.0, 1, 1))  # closes [100, 110) and [110, 120)
    folder.add(Request(108.0, 1, 1))  # its window has closed: late
    assert folder.late == 2
    assert _bounds(folder.flush()) == [(2, 120.0, 130.0, 1)]


def test_lateness_keeps_windows_open_for_out_of_order_records() -> None:
    spec = WindowSpec(length_s=10.0, step_s=10.0, lateness_s=5.0)
    folder = WindowFolder(spec, origin_s=0.0)
    folder.add(Request(1.0, 1, 1))
    assert folder.add(Request(12.0, 1, 1)) == []  # 12 < 10 + 5: window 0 still open
    assert folder.add(Request(9.0, 1, 1)) == []  # late by 3 s, within lateness
    closed = folder.add(Request(15.0, 1, 1))
    assert _bounds(closed) == [(0, 0.0, 10.0, 2)]
    assert folder.late == 0


def test_same_windows_whatever_the_order_within_a_window() -> None:
    rng = random.Random(7)
    times = sorted(rng.uniform(0, 100) for _ in range(400))
    reqs = [
        Request(t, rng.randint(1, 5000), rng.randint(1, 500), (rng.randint(0, 9),)) for t in times
    ]
    spec = WindowSpec(length_s=20.0, step_s=20.0, min_requests=5)
    expected = fold(reqs, spec, origin_s=0.0)
    # shuffle the records inside each tumbling window: the windows are identical
    shuffled: list[Request] = []
    for k in range(5):
        chunk = [r for r in reqs if 20 * k <= r.arrival_s < 20 * (k + 1)]
        rng.shuffle(chunk)
        shuffled += chunk
    assert fold(shuffled, spec, origin_s=0.0) == expected
    # and any order within the lateness of a sliding spec
    late = WindowSpec(length_s=20.0, step_s=10.0, min_requests=5, lateness_s=10.0)
    jittered = sorted(reqs, key=lambda r: r.arrival_s + rng.uniform(0, 9.9))
    assert fold(jittered, late, origin_s=0.0) == fold(reqs, late, origin_s=0.0)
    assert expected[0].shape() == fold(reqs, spec, origin_s=0.0)[0].shape()


def test_restart_by_re_adding_the_open_records() -> None:
    reqs = _reqs([float(t) for t in range(0, 60, 3)])
    spec = WindowSpec(length_s=10.0, step_s=5.0)
    whole = fold(reqs, spec)
    first = WindowFolder(spec)
    out = [w for r in reqs[:9] for w in first.add(r)]
    # the process dies; a fresh folder gets the same spec, origin, closed index and open records
    again = WindowFolder(spec, first.origin_s, closed_before=first.next_index)
    for r in first.open_requests():
        assert again.add(r) == []
    out += [w for r in reqs[9:] for w in again.add(r)] + again.flush()
    assert out == whole


def test_window_shape() -> None:
    ws = fold(_reqs([0.0, 1.0, 2.0]), WindowSpec(length_s=10.0, step_s=10.0))
    shape = ws[0].shape(max_batch=1)
    assert shape.source == "window 0"
    assert shape.batch_size == 1
    assert shape.isl_tokens.p50 == 101
    with pytest.raises(ValueError):
        TrafficWindow(3, 0.0, 1.0, (), True).shape()
