"""What one agent knows about its compilation, learnt only from the message board.

Agents never share memory: each keeps its own :class:`BoardView`, filled from the board's
history when it starts and kept current by following the board (claims and results of every
agent, the runner's baseline result included).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import nats.errors

from kiln.agent_runner.tasks import cancel_and_wait
from kiln.board import Board, BoardPost
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate

log = get_logger("kiln.agent_runner.view")


@dataclass(frozen=True)
class Seen:
    """A result posted on the board: the candidate, tokens/s, whether it was measured correct
    (status ok and correct), who posted it, and its per-op profile when it has one (``op_ms``:
    op name -> ms per decode step summed over layers; ``op_profile_shape``: layers,
    batch_size, context_len, dtype_bytes; both empty when not profiled)."""

    candidate: Candidate
    tokens_per_s: float
    ok: bool
    agent: str
    op_ms: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    op_profile_shape: dict[str, int] = field(default_factory=dict, compare=False, hash=False)


def result_body(candidate: Candidate, summary: dict[str, Any], speedup: float | None) -> dict:
    """The body of a result post: the candidate's recipe, the measurement summary (status,
    correct, tokens_per_s, median_ms, ...) and the speedup over the baseline (None if unknown)."""
    return {"candidate": candidate.canonical(), **summary, "speedup": speedup}


def seen_from_post(post: BoardPost) -> Seen | None:
    """A result post as :class:`Seen`; None when its body is not a result body."""
    body = post.body
    try:
        candidate = Candidate.from_canonical(body["candidate"])
        ok = body.get("status") == "ok" and bool(body.get("correct"))
        op_ms = {str(k): float(v) for k, v in (body.get("op_ms") or {}).items()}
        shape = {str(k): int(v) for k, v in (body.get("op_profile_shape") or {}).items()}
        tps = float(body.get("tokens_per_s") or 0.0)
        return Seen(candidate, tps, ok, post.agent, op_ms, shape)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


class BoardView:
    """Claims and results of one compilation as the board shows them.

    Attributes:
        claimed: ids of candidates some agent claimed.
        results: candidate id -> the result seen for it.
    """

    def __init__(self, board: Board, compilation_id: str) -> None:
        self._board = board
        self._cid = compilation_id
        self.claimed: set[str] = set()
        self.results: dict[str, Seen] = {}
        self._last_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    def take(self, post: BoardPost) -> None:
        """Fold one post (ideas are ignored)."""
        self._last_seq = max(self._last_seq, post.seq)
        if post.kind == "claim":
            self.claimed.add(post.candidate_id)
        elif post.kind == "result":
            seen = seen_from_post(post)
            if seen is not None and seen.candidate.id == post.candidate_id:
                self.results[post.candidate_id] = seen
                self.claimed.add(post.candidate_id)
                self._changed.set()

    @property
    def compilation_id(self) -> str:
        """The compilation this view follows."""
        return self._cid

    @property
    def in_flight(self) -> set[str]:
        """Candidates claimed by some agent whose result is not on the board yet."""
        return self.claimed - self.results.keys()

    async def wait_for_result(self, timeout_s: float) -> bool:
        """Wait until a new result is posted; False after ``timeout_s`` seconds without one."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def record(self, seen: Seen) -> None:
        """The agent's own result, known before the board echoes it."""
        self.results[seen.candidate.id] = seen
        self.claimed.add(seen.candidate.id)

    def ranked(self) -> list[Seen]:
        """Correct results, fastest first (ties by candidate id, so the order is stable)."""
        good = [s for s in self.results.values() if s.ok]
        return sorted(good, key=lambda s: (-s.tokens_per_s, s.candidate.id))

    async def start(self) -> None:
        """Read the board's history, then follow it in the background.

        Raises:
            nats.errors.Error: the board cannot be read.
        """
        for post in await self._board.history(self._cid, kinds=["claim", "result"]):
            self.take(post)
        self._task = asyncio.create_task(self._follow(), name=f"kiln-view-{self._cid}")

    async def _follow(self) -> None:
        while True:
            try:
                follow = self._board.follow(
                    self._cid, kinds=["claim", "result"], since_seq=self._last_seq
                )
                async with contextlib.aclosing(follow) as posts:
                    async for post in posts:
                        self.take(post)
            except asyncio.CancelledError:
                raise
            except nats.errors.ConnectionClosedError:
                return  # the process is shutting down
            except Exception as exc:
                log.warning("board follow stopped; resuming", error=str(exc))
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        """Stop following."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
