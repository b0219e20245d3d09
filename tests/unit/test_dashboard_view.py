"""A compilation folded for the dashboard (kiln.dashboard.view) and rendered
(kiln.dashboard.compilation_page): experiments with agents, tiers and phases, per-agent
best-so-far curves, baselines, filters, escaping of untrusted text, the self-contained report."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from kiln.dashboard.compilation_page import compilation_page, live_json, report_html
from kiln.dashboard.view import BoardMessage, CompilationView
from kiln.v1 import compiler_pb2, ledger_pb2

CID = "c1"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
EVIL = "<script>alert(1)</script>"


def _ts(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(T0 + timedelta(seconds=seconds))
    return ts


def _event(pos: int, stream: str, type_: str, at: float, **data: Any) -> ledger_pb2.RecordedEvent:
    return ledger_pb2.RecordedEvent(
        position=pos,
        stream_id=stream,
        type=type_,
        data=json.dumps(data).encode(),
        recorded_at=_ts(at),
    )


def _view() -> CompilationView:
    snap = compiler_pb2.Compilation(
        compilation_id=CID,
        team="t",
        status=compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
        created_at=_ts(0),
        updated_at=_ts(30),
        outcome="confirmed",
    )
    snap.progress.add(elapsed_s=20.0, tokens_per_s=50.0, speedup=1.2)
    view = CompilationView(snap)
    events = [
        _event(1, f"compilation-{CID}", "CompilationSubmitted", 0),
        _event(2, "experiment-e1", "ExperimentRequested", 1, compilation_id=CID,
               candidate_id="k1", tier="fast", agent="coordinate"),
        _event(3, "experiment-e1", "ExperimentCompleted", 2, compilation_id=CID,
               candidate_id="k1", tier="fast", status="ok", correct=True, tokens_per_s=100.0,
               median_ms=10.0, phases_ms={"reload": 3.0, "verify": 1.0, "time": 6.0}),
        _event(4, "experiment-e2", "ExperimentRequested", 3, compilation_id=CID,
               candidate_id="k2", tier="fast", agent="coordinate"),
        _event(5, "experiment-e2", "ExperimentCompleted", 5, compilation_id=CID,
               candidate_id="k2", tier="fast", status="crashed", correct=False, error=EVIL),
        _event(6, "experiment-e3", "ExperimentRequested", 6, compilation_id=CID,
               candidate_id="k3", tier="full", agent="confirm"),
        _event(7, "experiment-e3", "ExperimentCompleted", 9, compilation_id=CID,
               candidate_id="k3", tier="full", status="ok", correct=True, tokens_per_s=50.0),
        _event(8, "experiment-x9", "ExperimentRequested", 9, compilation_id="other",
               candidate_id="k9", tier="fast", agent="spy"),
        _event(9, f"compilation-{CID}", "BaselineCompared", 25, name="hf_eager",
               experiment_id="e7", status="incorrect", correct=False, tokens_per_s=20.0,
               error=EVIL),
        _event(10, f"compilation-{CID}", "CompilationEnded", 30, status="succeeded"),
    ]  # fmt: skip
    for event in events + events[:3]:  # a repeat changes nothing
        view.apply(event)
    view.board = [BoardMessage(1, "idea", EVIL, "k1", "2026-01-01T00:00:01", json.dumps(EVIL))]
    return view


def test_fold_keeps_this_compilations_experiments_with_agent_tier_and_phases() -> None:
    view = _view()
    assert sorted(view.experiments) == ["e1", "e2", "e3"]
    e1 = view.experiments["e1"]
    assert (e1.agent, e1.tier, e1.status, e1.correct) == ("coordinate", "fast", "ok", True)
    assert e1.phases_ms == {"reload": 3.0, "verify": 1.0, "time": 6.0}
    assert e1.requested_s == 1.0 and e1.completed_s == 2.0
    assert view.experiments["e2"].error == EVIL
    assert [b.name for b in view.baselines] == ["hf_eager"]
    assert view.first_position == 1 and view.last_position == 7 and view.end_position == 10
    assert view.agents() == ["confirm", "coordinate"]


def test_curves_are_best_so_far_per_agent_and_tier_then_the_confirmed_best() -> None:
    curves = {c.name: list(c.points) for c in _view().curves()}
    assert curves == {
        "confirm (full)": [(9.0, 50.0)],
        "coordinate (fast)": [(2.0, 100.0)],  # the crashed one adds no point
        "confirmed best": [(20.0, 50.0)],
    }


def test_page_escapes_untrusted_text_and_filters_rows() -> None:
    view = _view()
    page = compilation_page(view, {}, "t")
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert page.count("<script") == 1  # the dashboard's own script only
    assert '<script src="/static/dashboard.js" defer></script>' in page
    assert len(re.findall(r'<tr class="exp', page)) == 3
    assert '<tr class="phase"><td>reload</td><td class="num">3.0</td>' in page
    assert 'id="board"' in page and 'id="baselines"' in page and "hf_eager" in page
    assert "data-live" not in page  # ended: no polling
    only_full = compilation_page(view, {"tier": "full"}, "t")
    assert re.findall(r'<tr class="exp[^"]*" data-id="(\w+)"', only_full) == ["e3"]
    crashed = compilation_page(view, {"status": "crashed", "agent": "coordinate"}, "t")
    assert re.findall(r'<tr class="exp[^"]*" data-id="(\w+)"', crashed) == ["e2"]


def test_a_running_compilation_polls_its_json() -> None:
    view = _view()
    view.snapshot.status = compiler_pb2.COMPILATION_STATUS_RUNNING
    page = compilation_page(view, {}, "t")
    assert f'data-live="/api/compilations/{CID}"' in page
    live = live_json(view)
    assert live["ended"] is False and live["status"] == "running"
    assert live["plot"].startswith("<svg") and "<script" not in live["experiments-body"]
    json.dumps(live)


def test_report_is_self_contained() -> None:
    html = report_html(_view())
    assert "<script" not in html.replace("&lt;script", "")
    assert "<style>" in html and "<svg" in html
    assert not re.search(r'(src|href)="(?!/compilations)', html)


def test_the_board_is_skipped_at_once_for_a_user_that_may_not_read_it(tmp_path: Any) -> None:
    """kiln up's `cli` NATS user may not read the board (every team's posts): the page says so
    without waiting on the server; an agent-runner user or an open server is asked."""
    from kiln.common.settings import KilnSettings
    from kiln.dashboard.source import _board_refused

    def settings(user: str | None) -> KilnSettings:
        extra = {"nats_user": user, "nats_password": "pw"} if user else {}
        return KilnSettings(state_dir=tmp_path, nats_url="nats://127.0.0.1:1", **extra)

    assert "'cli' may not read it" in _board_refused(settings("cli"))
    assert _board_refused(settings("agent-runner")) == ""
    assert _board_refused(settings("operator")) == ""
    assert _board_refused(settings(None)) == ""
    assert _board_refused(settings("someone-else")) == ""


def test_the_page_says_what_each_move_of_the_best_bought() -> None:
    from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, Transform

    evil = Candidate.make({"attention": EVIL})
    best = Candidate.make({"attention": EVIL}, [Transform.of("threads", n=2)])
    snap = compiler_pb2.Compilation(
        compilation_id=CID, status=compiler_pb2.COMPILATION_STATUS_SUCCEEDED, created_at=_ts(0)
    )
    snap.best.candidate.CopyFrom(best.to_proto())
    view = CompilationView(snap)
    results = [(REFERENCE_CANDIDATE, 100.0), (evil, 130.0), (best, 260.0), (best, 250.0)]
    pos = 0
    for i, (c, tps) in enumerate(results):
        for type_, extra in (
            ("ExperimentRequested", {"candidate": c.canonical(), "agent": "coordinate"}),
            ("ExperimentCompleted", {"status": "ok", "correct": True, "tokens_per_s": tps}),
        ):
            pos += 1
            view.apply(
                _event(pos, f"experiment-m{i}", type_, pos, compilation_id=CID,
                       candidate_id=c.id, tier="fast", **extra)
            )  # fmt: skip
    effects = {m.move: m for m in view.move_effects()}
    assert effects["threads(n=2)"].factor == 255.0 / 130.0  # the median of the best's two
    assert effects[f"attention={EVIL}"].evidence == "alone"
    page = compilation_page(view, {}, "t")
    assert 'id="moves"' in page and "1.96x" in page and "1.30x" in page
    assert EVIL not in page  # the op's name is escaped
