"""How ``kiln ledger query`` shows rows to people: one table, a row per result, and a line
for no rows (the ledger call itself is replaced; the rendering is what is tested)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from kiln.cli import ledger as ledger_cli
from kiln.cli import render
from kiln.cli.main import app
from kiln.cli.render import MAIN_COLUMNS, rows_table


def _compilation(i: int) -> dict[str, Any]:
    return {
        "compilation_id": f"c{i}",
        "team": "search",
        "workload_key": f"wk-{i}",
        "model_name": "tiny",
        "hardware": "cpu",
        "status": "running",
        "budget_wall_seconds": 60.0,
        "budget_max_experiments": 10,
        "experiments_done": i,
        "failures": 0,
        "baseline_tokens_per_s": 100.0,
        "best_candidate_id": None,
        "best_tokens_per_s": 123.456,
        "speedup": 1.23456,
        "reason": "",
        "created_at": "2026-11-30T07:26:54.095727+00:00",
        "updated_at": "2026-11-30T07:26:55.5Z",
        "last_position": 7,
    }


@pytest.fixture
def answer(monkeypatch: pytest.MonkeyPatch) -> list[list[dict[str, Any]]]:
    """Set ``answer[0]`` to the rows the (replaced) ledger returns."""
    rows: list[list[dict[str, Any]]] = [[]]
    monkeypatch.setattr(ledger_cli, "run_with_ledger", lambda *_a, **_k: rows[0])
    monkeypatch.setenv("COLUMNS", "250")  # for a console made from now on; the one made at
    monkeypatch.setattr(render.console, "_width", 250)  # import read COLUMNS then, if at all
    return rows


def test_rows_are_one_table_with_a_row_each(answer: list[list[dict[str, Any]]]) -> None:
    answer[0] = [_compilation(1), _compilation(2), _compilation(3)]
    result = CliRunner().invoke(app, ["ledger", "query", "compilations"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].strip() == "compilations: 3 rows"
    header = next(line for line in lines if "compilation_id" in line)
    for column in ("compilation_id", "status", "best_tokens_per_s", "updated_at"):
        assert column in header
    assert "budget_wall_seconds" not in header  # a chosen subset; --json has everything
    body = [line for line in lines if line.startswith("│ c")]
    assert len(body) == 3  # one row per result, not a table per row
    assert "2026-11-30 07:26:55" in body[0] and "123.46" in body[0]
    assert "not shown:" in result.output and "--json" in result.output


def test_no_rows_prints_a_zero_rows_line(answer: list[list[dict[str, Any]]]) -> None:
    result = CliRunner().invoke(app, ["ledger", "query", "experiments", "--filter", "status=ok"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "experiments: 0 rows where status=ok"


def test_json_has_every_column(answer: list[list[dict[str, Any]]]) -> None:
    answer[0] = [_compilation(1)]
    result = CliRunner().invoke(app, ["ledger", "query", "compilations", "--json"])
    assert json.loads(result.output) == _compilation(1)


def test_rows_table_without_known_columns_keeps_the_first_ones() -> None:
    rows = [{f"col{i}": i for i in range(14)}]
    table, hidden = rows_table(rows, "something-new")
    assert [c.header for c in table.columns] == [f"col{i}" for i in range(10)]
    assert hidden == ["col10", "col11", "col12", "col13"]
    assert set(MAIN_COLUMNS) == {"compilations", "experiments", "best-candidates"}


def test_narrow_terminal_leaves_out_trailing_columns_not_rows() -> None:
    rows = [_compilation(1), _compilation(2)]
    wide, _ = rows_table(rows, "compilations", width=250)
    narrow, hidden = rows_table(rows, "compilations", width=70)
    assert 1 < len(narrow.columns) < len(wide.columns)
    assert narrow.columns[0].header == "compilation_id"
    assert "updated_at" in hidden and narrow.row_count == 2


def test_replay_table_says_what_was_applied() -> None:
    from rich.console import Console

    from kiln.cli.render import replay_table
    from kiln.v1 import ledger_pb2

    response = ledger_pb2.ReplayResponse(
        checkpoint_position=9,
        events_replayed=9,
        projections=[
            ledger_pb2.ProjectionReplay(
                name="compilations", rows_live=2, rows_rebuilt=2, equal=True
            ),
            ledger_pb2.ProjectionReplay(name="experiments", rows_live=3, rows_rebuilt=4),
            ledger_pb2.ProjectionReplay(name="bests", rows_live=1, rows_rebuilt=2, applied=True),
        ],
    )
    console = Console(width=120, record=True)
    console.print(replay_table(response))
    lines = console.export_text().splitlines()
    row = {line.split()[1]: line for line in lines if line.startswith("│ ")}
    assert "not needed" in row["compilations"]
    assert row["experiments"].split("│")[-2].strip() == "no"
    assert row["bests"].split("│")[-2].strip() == "yes"
