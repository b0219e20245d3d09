"""Helpers for the strategy tests: a BoardView filled by hand (no NATS) and result posts."""

from __future__ import annotations

from typing import Any, cast

from kiln.agent_runner.agents.view import BoardView, result_body
from kiln.board import Board, BoardPost
from kiln.domain.candidate import Candidate


def view_of(*posts: BoardPost, compilation_id: str = "c1") -> BoardView:
    """A view folded from ``posts`` by hand."""
    view = BoardView(cast(Board, None), compilation_id)
    for post in posts:
        view.take(post)
    return view


def result(
    c: Candidate,
    tps: float,
    *,
    status: str = "ok",
    agent: str = "x",
    seq: int = 1,
    op_ms: dict[str, float] | None = None,
    shape: dict[str, int] | None = None,
) -> BoardPost:
    """A result post for ``c`` at ``tps`` tokens/s (with a per-op profile if given)."""
    summary: dict[str, Any] = {"status": status, "correct": status == "ok", "tokens_per_s": tps}
    if op_ms is not None:
        summary["op_ms"] = op_ms
        summary["op_profile_shape"] = shape or {}
    body = result_body(c, summary, None)
    return BoardPost(
        kind="result", compilation_id="c1", candidate_id=c.id, agent=agent, body=body, seq=seq
    )


def claim(c: Candidate, agent: str = "x", seq: int = 1) -> BoardPost:
    """A claim post for ``c``."""
    return BoardPost(kind="claim", compilation_id="c1", candidate_id=c.id, agent=agent, seq=seq)
