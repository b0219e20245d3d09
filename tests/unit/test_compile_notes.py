"""``kiln compile``'s summary legend (kiln.cli.compile_notes: like-with-like baselines, noisy
timing, weak rank agreement, the reason of a compilation that confirmed nothing) and its Ctrl-C
under ``--one-shot`` (the cancel is asked for before kiln is brought down)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kiln.cli.compile_notes import agreement_of, baseline_rows, summary_warnings
from kiln.cli.compile_view import CompileView, summary_table
from kiln.cli.main import app
from kiln.domain.judging import NONE_CONFIRMED, agreement_text
from kiln.v1 import common_pb2, compiler_pb2

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
LLAMA = DATA / "models" / "llama-3.2-1b.json"
CONV = DATA / "traces" / "azure_llm_2023_conv.csv"


def _timing(median: float, p10: float, p90: float) -> common_pb2.Timing:
    return common_pb2.Timing(median_ms=median, p10_ms=p10, p90_ms=p90)


def _snap(reason: str = "", **best: Any) -> compiler_pb2.Compilation:
    snap = compiler_pb2.Compilation(
        compilation_id="c",
        status=compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
        reason=reason,
        experiments_done=12,
        baseline=common_pb2.Measurement(
            tokens_per_s=141.0, tier=common_pb2.TIER_FAST, timing=_timing(56.0, 55.0, 58.0)
        ),
    )
    if best:
        snap.best.CopyFrom(
            common_pb2.BestCandidate(
                speedup=best.get("speedup", 1.33),
                measurement=common_pb2.Measurement(
                    tokens_per_s=56.0,
                    tier=common_pb2.TIER_FULL,
                    timing=best.get("timing", _timing(142.0, 140.0, 146.0)),
                ),
                reference=common_pb2.Measurement(
                    tokens_per_s=best.get("ref", 42.1), tier=common_pb2.TIER_FULL
                ),
            )
        )
    return snap


def _text(renderable: Any) -> str:
    console = Console(record=True, width=200)
    console.print(renderable)
    return console.export_text()


def test_a_full_tier_best_stands_beside_the_full_tier_reference() -> None:
    rows = dict(baseline_rows(_snap(best=True)))
    assert rows["baseline"] == "42.1 tok/s (full tier, the reference measured next to the best)"
    assert rows["fast-tier baseline"].startswith("141.0 tok/s (fast tier: a few layers")
    # Without the full-tier reference's figure nothing is called "the" baseline.
    assert set(dict(baseline_rows(_snap(best=True, ref=0.0)))) == {"fast-tier baseline"}
    assert baseline_rows(_snap()) == [("baseline", "141.0 tok/s, fast tier")]


def test_the_live_line_puts_each_figure_beside_its_own_tier() -> None:
    view = CompileView("c", budget_s=60)
    view.snapshot = _snap(best=True)
    text = _text(view.render())
    assert "baseline 141.0 tok/s (fast)  ·  best 56.0 tok/s (full, 1.33x its reference 42.1" in text


def test_noisy_timing_is_a_warning() -> None:
    quiet = _snap(best=True)
    assert summary_warnings(quiet) == []
    noisy = _snap(best=True, timing=_timing(142.0, 33.1, 276.8))  # 28.9-242 tok/s at batch 8
    (warning,) = summary_warnings(noisy)
    assert warning.startswith("noisy timing: the best's steps spread over 172% of their median")
    assert "warning" in _text(summary_table(noisy)) and "noisy timing" in _text(
        summary_table(noisy)
    )


@pytest.mark.parametrize(
    ("n", "rho", "kind"),
    [
        (5, 0.8, None),
        (5, 0.3, "weak"),
        (4, -0.2, "negative"),
        (2, -1.0, "negative"),
        (2, 0.0, None),
    ],
)
def test_a_weak_or_negative_rank_agreement_is_a_warning(
    n: int, rho: float, kind: str | None
) -> None:
    reason = f"the wall-clock budget of 60 s is spent; {agreement_text(n, rho)}"
    assert agreement_of(reason) == (n, pytest.approx(rho, abs=0.005))
    warnings = summary_warnings(_snap(reason, best=True))
    if kind is None:
        assert warnings == []
    else:
        (warning,) = warnings
        assert warning.startswith(f"{kind} fast/full rank agreement (Spearman rho {rho:.2f}")


def test_a_compilation_that_confirmed_nothing_says_why() -> None:
    why = "the fast tier's leader (threads(n=2), 1.30x there) was not measured on the full tier"
    reason = f"{NONE_CONFIRMED}{why}; the experiment budget is spent (8 of 8 experiments)"
    snap = _snap(reason + "; " + agreement_text(1, None))
    snap.outcome = "unconfirmed"
    text = _text(summary_table(snap))
    assert (
        "succeeded, but no candidate was confirmed (the experiment budget is spent (8 of 8" in text
    )
    assert f"none: {why}" in text
    assert "fast vs full" in text and "1 candidate measured on both tiers" in text


@pytest.mark.skipif(not LLAMA.is_file(), reason="../shared/data is not here")
@pytest.mark.parametrize("how", ["task cancelled", "KeyboardInterrupt"])
def test_ctrl_c_on_a_one_shot_cancels_before_kiln_goes_down(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A Ctrl-C inside the watch's loop (asyncio cancels its task) asks the cancel in that loop;
    one that escapes the loop as KeyboardInterrupt asks it in a loop of its own."""
    import kiln.cli.compile as compile_cmd
    import kiln.embedded.supervisor as supervisor

    order: list[str] = []

    class Row:
        healthy = False

    class FakeSupervisor:
        def __init__(self, settings: Any) -> None:
            pass

        def status(self) -> list[Row]:
            return [Row()]

        def up(self, start_services: bool) -> None:
            order.append("up")

        def down(self) -> None:
            order.append("down")

    loops: list[object] = []

    async def interrupted(*args: Any, **kw: Any) -> Any:
        loops.append(asyncio.get_running_loop())
        if how == "KeyboardInterrupt":
            raise KeyboardInterrupt
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # what asyncio.run does on SIGINT
        await asyncio.sleep(5)

    async def cancel(settings: Any, compilation_id: str) -> str:
        loops.append(asyncio.get_running_loop())
        order.append(f"cancel {compilation_id}")
        return f"cancelled compilation {compilation_id} (Ctrl-C)"

    monkeypatch.setattr(supervisor, "Supervisor", FakeSupervisor)
    monkeypatch.setattr(compile_cmd, "submit_and_watch", interrupted)
    monkeypatch.setattr(compile_cmd, "cancel_compilation", cancel)
    args = ["compile", "--model", str(LLAMA), "--traffic", str(CONV), "--one-shot", "--id", "c1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 130, result.output
    assert order == ["up", "cancel c1", "down"]
    assert "cancelled compilation c1 (Ctrl-C)" in result.output
    assert (loops[0] is loops[1]) == (how == "task cancelled")
