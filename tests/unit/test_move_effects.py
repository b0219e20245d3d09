"""What each move bought: leave-one-out first, the move alone over the reference next, never a
made-up number; repeats as their median; one tier at a time; folded from Watch events."""

from __future__ import annotations

import pytest
from google.protobuf.struct_pb2 import Struct

from kiln.cli.compile_view import CompileView, summary_table
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, Transform
from kiln.domain.move_effects import Measured, move_effects
from kiln.v1 import common_pb2, compiler_pb2

SDPA = Candidate.make({"attention": "sdpa"})
THREADS = Candidate.make(transforms=[Transform.of("threads", n=2)])
GRAPH = Candidate.make(transforms=[Transform.of("cuda_graph")])
BEST = Candidate.make(
    {"attention": "sdpa"}, [Transform.of("threads", n=2), Transform.of("cuda_graph")]
)


def fast(c: Candidate, tps: float, tier: str = "fast") -> Measured:
    return Measured(c, tier, tps)


def test_leave_one_out_then_alone_then_unmeasured() -> None:
    without_threads = Candidate.make({"attention": "sdpa"}, [Transform.of("cuda_graph")])
    measured = [
        fast(BEST, 300.0),
        fast(without_threads, 200.0),  # threads: 300 / 200
        fast(REFERENCE_CANDIDATE, 100.0),
        fast(SDPA, 125.0),  # attention alone: 125 / 100
    ]
    effects = {e.move: e for e in move_effects(BEST, measured, "fast")}
    assert list(effects) == ["attention=sdpa", "cuda_graph", "threads(n=2)"]
    assert effects["threads(n=2)"].evidence == "without"
    assert effects["threads(n=2)"].factor == pytest.approx(1.5)
    assert effects["attention=sdpa"].evidence == "alone"
    assert effects["attention=sdpa"].factor == pytest.approx(1.25)
    assert effects["cuda_graph"].evidence == "unmeasured"
    assert effects["cuda_graph"].factor is None
    assert "not measured" in effects["cuda_graph"].text()
    assert effects["threads(n=2)"].text() == "threads(n=2): 1.50x (without it 200.0 tok/s)"


def test_repeats_count_as_their_median_and_other_tiers_are_ignored() -> None:
    measured = [
        fast(THREADS, 150.0),
        fast(THREADS, 900.0),
        fast(THREADS, 160.0),
        fast(REFERENCE_CANDIDATE, 100.0),
        fast(REFERENCE_CANDIDATE, 50.0, tier="full"),
    ]
    (effect,) = move_effects(THREADS, measured, "fast")
    assert effect.evidence == "without"  # without its only move it is the reference
    assert effect.factor == pytest.approx(1.6)


def test_nothing_for_the_reference_or_an_unmeasured_best() -> None:
    measured = [fast(REFERENCE_CANDIDATE, 100.0), fast(SDPA, 120.0)]
    assert move_effects(REFERENCE_CANDIDATE, measured, "fast") == []
    assert move_effects(BEST, measured, "fast") == []
    assert move_effects(SDPA, measured, "full") == []


def _event(kind: str, **detail: object) -> compiler_pb2.CompilationEvent:
    s = Struct()
    s.update(detail)
    return compiler_pb2.CompilationEvent(type=kind, detail=s)


def test_the_compile_summary_says_what_each_move_bought() -> None:
    view = CompileView("c1", 60.0)
    for cid, (c, tps, ok) in {
        "r": (REFERENCE_CANDIDATE, 100.0, True),
        "s": (SDPA, 130.0, True),
        "t": (THREADS, 400.0, False),  # incorrect: not evidence
        "b": (Candidate.make({"attention": "sdpa"}, [Transform.of("threads", n=2)]), 260.0, True),
    }.items():
        view.update(
            _event("ExperimentRequested", candidate_id=c.id, tier="fast", candidate=c.canonical())
        )
        view.update(
            _event(
                "ExperimentCompleted",
                candidate_id=c.id,
                tier="fast",
                status="ok",
                correct=ok,
                tokens_per_s=tps,
            )
        )
        del cid
    best = Candidate.make({"attention": "sdpa"}, [Transform.of("threads", n=2)])
    view.snapshot = compiler_pb2.Compilation(
        compilation_id="c1",
        status=compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
        best=common_pb2.BestCandidate(
            candidate=best.to_proto(),
            measurement=common_pb2.Measurement(tokens_per_s=250.0, tier=common_pb2.TIER_FULL),
            speedup=2.0,
        ),
    )
    effects = {e.move: e for e in view.move_effects()}
    assert effects["threads(n=2)"].factor == pytest.approx(2.0)  # 260 / 130
    assert effects["attention=sdpa"].evidence == "alone"  # threads alone was incorrect
    assert effects["attention=sdpa"].factor == pytest.approx(1.3)
    from rich.console import Console

    console = Console(width=80, record=True)
    console.print(summary_table(view.snapshot, view.move_effects()))
    text = console.export_text()
    assert "what each move bought" in text
    assert "threads(n=2): 2.00x (without it 130.0 tok/s)" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def _listed(cid: str, status: int, outcome: str = "") -> compiler_pb2.Compilation:
    c = compiler_pb2.Compilation(compilation_id=cid, team="alpha", status=status, outcome=outcome)
    c.workload.model.name = "llama-3.2-1b"
    c.workload.hardware.name = "h200"
    return c


def test_the_listing_fits_80_columns_and_says_what_a_search_came_to() -> None:
    from kiln.cli.compilations import list_lines

    rows = [
        _listed("a" * 32, compiler_pb2.COMPILATION_STATUS_SUCCEEDED, "none_beat_the_baseline"),
        _listed("b" * 32, compiler_pb2.COMPILATION_STATUS_SUCCEEDED, "confirmed"),
        _listed("c" * 32, compiler_pb2.COMPILATION_STATUS_RUNNING),
    ]
    narrow = list_lines(rows, 80)
    assert max(map(len, narrow)) <= 80
    assert "no win" in narrow[1] and "confirmed" in narrow[3] and "running" in narrow[5]
    assert narrow[2].strip() == "llama-3.2-1b on h200"  # the workload on a line of its own
    wide = list_lines(rows, 120)
    assert len(wide) == 4 and wide[1].endswith("llama-3.2-1b on h200")
    assert wide[1].startswith("a" * 32)  # the id whole, first
