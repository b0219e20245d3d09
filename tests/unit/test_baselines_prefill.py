"""Prefill beside the baselines (issue 10, item 3): ``BaselineCompared`` carries the baseline's
prefill median (old events without it stay readable), the side-by-side table shows a "prefill
ms" column for the baselines, kiln's reference and kiln's best (blank where not timed) and says
what it measured, and kiln's best is flagged, in a note only, when its prefill is slower than
the reference's measured next to it beyond the reference's spread in the run."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from kiln.baselines.table import Comparison, PrefillCheck
from kiln.cli.compile_view import comparison_table, prefill_text
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.events.registry import SchemaError, validate_event
from kiln.v1 import common_pb2

from .test_baselines_table_limit import _events, _snapshot

WINNER = Candidate.make({"attention": "sdpa"})
POINT = {"batch_size": 1, "context_len": 7084}
OK = {"tier": "full", "status": "ok", "correct": True, **POINT}


def _reference(prefill: float, tps: float = 400.0, **kw: Any) -> tuple[str, dict[str, Any]]:
    detail = {"candidate_id": REFERENCE_CANDIDATE.id, **OK, "tokens_per_s": tps,
              "median_ms": 1e3 / tps, "prefill_median_ms": prefill, **kw}  # fmt: skip
    return "ExperimentCompleted", detail


def _winner(prefill: float, **kw: Any) -> tuple[str, dict[str, Any]]:
    detail = {"candidate_id": WINNER.id, **OK, "tokens_per_s": 1000.0, "median_ms": 1.0,
              "prefill_median_ms": prefill, **kw}  # fmt: skip
    return "ExperimentCompleted", detail


def _comparison(*extra: tuple[str, dict[str, Any]], prefill: bool = True) -> Comparison:
    """The table events of test_baselines_table_limit (old events: no prefill), gpt_fast's
    BaselineCompared with its prefill when ``prefill``, then ``extra``."""
    c = Comparison(REFERENCE_CANDIDATE.id)
    for kind, detail in _events():
        c.update(kind, detail)
    if prefill:
        c.update("BaselineCompared", {**c.baselines["gpt_fast"], "prefill_median_ms": 61.4})
    for kind, detail in extra:
        c.update(kind, detail)
    return c


def _render(c: Comparison, width: int = 200, best_tier: int = common_pb2.TIER_FULL) -> str:
    snap = _snapshot(best_tier=best_tier)
    snap.best.candidate.candidate_id = WINNER.id
    table = comparison_table(c, snap)
    assert table is not None
    console = Console(width=width, record=True)
    console.print(table)
    return console.export_text()


def _cells(text: str) -> dict[str, dict[str, str]]:
    """Row label -> header -> cell, from a table rendered wide enough not to wrap cells (the
    headers' two lines are joined)."""
    lines = text.splitlines()
    heads = [line.split("┃")[1:-1] for line in lines if line.count("┃") > 2]
    names = [" ".join(h.strip() for h in col).strip() for col in zip(*heads, strict=True)]
    out = {}
    for line in lines:
        if line.count("│") > 2:
            cells = [c.strip() for c in line.split("│")[1:-1]]
            out[cells[0]] = dict(zip(names, cells, strict=True))
    return out


# ---------------------------------------------------------------------- the event
def test_baseline_compared_takes_a_prefill_and_reads_old_events() -> None:
    base = {"name": "gpt_fast", "experiment_id": "e1", "status": "ok", "batch": 1}
    _, new = validate_event("compilation-c1", "BaselineCompared", 0,
                            {**base, "prefill_median_ms": 61.4})  # fmt: skip
    assert new["prefill_median_ms"] == 61.4
    _, old = validate_event("compilation-c1", "BaselineCompared", 0, base)
    assert old["prefill_median_ms"] == 0.0
    with pytest.raises(SchemaError, match="prefill_median_ms"):
        validate_event("compilation-c1", "BaselineCompared", 0,
                       {**base, "prefill_median_ms": -1.0})  # fmt: skip


# ---------------------------------------------------------------------- the table
def test_the_table_has_a_prefill_column_and_says_what_it_measured() -> None:
    c = _comparison(_reference(70.2), _reference(71.0), _winner(75.3))
    text = _render(c)
    cells = _cells(text)
    assert cells["gpt_fast"]["prefill ms"] == "61.40"
    assert cells["hf_compile"]["prefill ms"] == "-"  # its event predates the field
    assert cells["kiln reference"]["prefill ms"] == "71.00"  # the last full-tier reference
    assert cells["kiln best"]["prefill ms"] == "75.30"
    assert cells["gpt_fast"]["tok/s"] == "742.0"  # the other columns are where they were
    flat = " ".join(text.split())
    assert "prefill ms: median of timed prefills of 1 x 7,084 prompt tokens" in flat


def test_old_events_leave_the_column_blank_and_flag_nothing() -> None:
    c = _comparison(prefill=False)  # no prefill anywhere, as before the field existed
    cells = _cells(_render(c))
    assert {row["prefill ms"] for row in cells.values()} == {"-"}
    assert "PREFILL" not in _render(c) and "prefill +" not in _render(c)
    assert c.prefill_check(WINNER.id) is None


def test_a_best_slower_than_the_reference_beyond_its_spread_is_flagged() -> None:
    c = _comparison(_reference(70.2), _reference(71.0), _winner(75.3))
    check = c.prefill_check(WINNER.id)
    assert check == PrefillCheck(75.3, 71.0, pytest.approx(0.8), 2)
    assert check is not None and check.slower
    text = _render(c)
    assert _cells(text)["kiln best"][""] == "PREFILL SLOWER +6%"
    flat = " ".join(text.split())
    assert "kiln best prefill 75.30 ms vs 71.00 ms for the reference measured next to it" in flat
    assert "SLOWER, beyond the reference's spread (0.80 ms over 2 runs)" in flat
    # a note only: the best stays the best, with its speedup
    assert _cells(text)["kiln best"]["vs kiln ref"] == "2.50x"


@pytest.mark.parametrize(
    ("events", "note", "slower"),
    [
        ([_reference(70.2), _reference(71.0), _winner(71.5)], "prefill +1% (within noise)", False),
        ([_reference(71.0), _winner(75.3)], "prefill +6% (noise unknown)", False),
        ([_reference(70.2), _reference(71.0), _winner(66.0)], "prefill -7%", False),
    ],
    ids=["within the spread", "one reference run", "faster"],
)
def test_what_is_not_flagged(
    events: list[tuple[str, dict[str, Any]]], note: str, slower: bool
) -> None:
    c = _comparison(*events)
    check = c.prefill_check(WINNER.id)
    assert check is not None and check.slower is slower
    assert _cells(_render(c))["kiln best"][""] == note


def test_the_reference_next_to_the_best_is_the_one_measured_before_it() -> None:
    # ref 71.0, the winner, then a later (slower host) reference 80.0 and a failed one
    later = _reference(80.0, tps=390.0)
    failed = _reference(10.0, status="incorrect", correct=False)
    c = _comparison(_reference(71.0), _winner(75.3), later, failed)
    check = c.prefill_check(WINNER.id)
    assert check is not None and check.reference_ms == 71.0  # not 80.0: measured next to it
    assert c.reference_prefills == [71.0, 80.0]  # the failed one is no measurement
    assert check.spread_ms == pytest.approx(9.0) and not check.slower  # 4.3 ms < 9 ms
    cells = _cells(_render(c))
    assert cells["kiln reference"]["prefill ms"] == "80.00"  # the row shows the last one


def test_a_fast_tier_best_or_an_unconfirmed_one_has_no_prefill() -> None:
    c = _comparison(_reference(70.2), _reference(71.0), _winner(75.3))
    cells = _cells(_render(c, best_tier=common_pb2.TIER_FAST))
    assert cells["kiln best"]["prefill ms"] == "-" and cells["kiln best"][""] == ""
    assert c.prefill_check("not-confirmed") is None
    c = _comparison(_reference(70.2), _reference(71.0), _winner(75.3, status="crashed"))
    assert c.prefill_check(WINNER.id) is None
    assert _cells(_render(c))["kiln best"]["prefill ms"] == "-"


def test_the_table_fits_80_columns() -> None:
    c = _comparison(_reference(70.2), _reference(71.0), _winner(1234.5))
    c.update("BaselineCompared", {**c.baselines["gpt_fast"], "tokens_per_s": 11190.6})
    text = _render(c, width=80)
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80
    assert "hf_compile" in text and "…" not in text  # labels and figures are never cut
    assert "1,234.5" in text and "11,190.6" in text and "61.40" in text


def test_prefill_text() -> None:
    assert (prefill_text(0), prefill_text(61.4), prefill_text(1234.56)) == ("-", "61.40", "1,234.6")
