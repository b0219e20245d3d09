"""What one agent knows about its compilation: claims from the board (its history, then followed)
and results from the compilation's :class:`~kiln.agent_runner.results.ResultFeed`.
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors

from kiln.agent_runner.outage import ride_out
from kiln.agent_runner.results import ResultFeed, SearchResult, Seen
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.board import Board, BoardPost
from kiln.common.logging import get_logger

log = get_logger("kiln.agent_runner.view")


class BoardView:
    """Claims and results of one compilation, taken from the feed until :meth:`close`.

    Attributes:
        claimed: ids of candidates claimed (or whose result is known).
        results: candidate id -> the result seen.
    """

    def __init__(self, board: Board, compilation_id: str, feed: ResultFeed) -> None:
        self._board = board
        self._cid = compilation_id
        self.feed = feed
        self.claimed: set[str] = set()
        self.results: dict[str, Seen] = {}
        self._last_seq = 0
        self._task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()
        for result in feed:
            self.take_result(result)
        self._unlisten = feed.listen(self.take_result)

    def take(self, post: BoardPost) -> None:
        """Fold one board post (only claims count)."""
        self._last_seq = max(self._last_seq, post.seq)
        if post.kind == "claim":
            self.claimed.add(post.candidate_id)

    def take_result(self, result: SearchResult) -> None:
        """Fold one result of the feed."""
        self.results[result.candidate.id] = result
        self.claimed.add(result.candidate.id)
        self._changed.set()

    @property
    def compilation_id(self) -> str:
        return self._cid

    @property
    def in_flight(self) -> set[str]:
        """Candidates claimed by some agent whose result is not known yet."""
        return self.claimed - self.results.keys()

    async def wait_for_result(self, timeout_s: float) -> bool:
        """Wait until a new result comes; False after ``timeout_s`` seconds without one."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def record(self, seen: Seen) -> None:
        """The agent's own result, as its measurement returned it."""
        self.results[seen.candidate.id] = seen
        self.claimed.add(seen.candidate.id)

    def ranked(self) -> list[Seen]:
        """Correct results, fastest first (ties by candidate id, so the order is stable)."""
        good = [s for s in self.results.values() if s.ok]
        return sorted(good, key=lambda s: (-s.tokens_per_s, s.candidate.id))

    async def start(self) -> None:
        """Read the board's claims (NATS being away is waited out), then follow them in the
        background; NATS errors if it refuses.
        """
        posts = await ride_out(
            lambda: self._board.history(self._cid, kinds=["claim"]),
            what="read the board",
            compilation=self._cid,
        )
        for post in posts:
            self.take(post)
        self._task = asyncio.create_task(self._follow(), name=f"kiln-view-{self._cid}")

    async def _follow(self) -> None:
        while True:
            try:
                follow = self._board.follow(self._cid, kinds=["claim"], since_seq=self._last_seq)
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
        """Stop following the board and the feed."""
        self._unlisten()
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
