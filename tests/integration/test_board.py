"""The message board against a real NATS JetStream (no mocks)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from nats.aio.client import Client

from kiln.board import Board, BoardPost
from kiln.common import nats as kn
from kiln.common.errors import InvalidArgument

pytestmark = pytest.mark.integration


@pytest.fixture
def board(nc: Client, prefix: str) -> Board:
    return Board(nc.jetstream(), prefix)


async def test_post_history_follow_round_trip(board: Board) -> None:
    idea = await board.post_idea("comp1", "cand-a", "agent-1", {"recipe": {"attention": "flash"}})
    assert await board.claim("comp1", "cand-a", "agent-1") is True
    later = await board.post_idea("comp1", "cand-a", "agent-2", {"why": "again"})
    await board.post_idea("comp2", "cand-z", "agent-9")  # another compilation: never seen below

    posts = await board.history("comp1")
    assert [p.kind for p in posts] == ["idea", "claim", "idea"]
    assert [p.seq for p in posts] == sorted(p.seq for p in posts)
    assert posts[0] == idea
    assert posts[0].body == {"recipe": {"attention": "flash"}}
    assert posts[2] == later
    assert all(p.compilation_id == "comp1" and p.candidate_id == "cand-a" for p in posts)
    assert [p.kind for p in await board.history("comp1", kinds=["idea"])] == ["idea", "idea"]
    assert [p.kind for p in await board.history("comp1", kinds=["idea", "claim"])] == [
        "idea",
        "claim",
        "idea",
    ]
    assert await board.history("nobody") == []
    assert await board.claimed("comp1") == {"cand-a"}
    assert await board.claimed("comp2") == set()

    async with contextlib.aclosing(board.follow("comp1")) as live:
        got = [await asyncio.wait_for(anext(live), 5.0) for _ in range(3)]
    assert got == posts
    async with contextlib.aclosing(board.follow("comp1", since_seq=posts[0].seq)) as live:
        assert await asyncio.wait_for(anext(live), 5.0) == posts[1]
    async with contextlib.aclosing(board.follow("comp1", kinds=["claim"])) as live:
        assert await asyncio.wait_for(anext(live), 5.0) == posts[1]


async def test_retried_posts_are_stored_once(board: Board) -> None:
    a = await board.post_idea("comp1", "cand-a", "agent-1", {"x": 1})
    b = await board.post_idea("comp1", "cand-a", "agent-1", {"x": 1})
    c = await board.post_idea("comp1", "cand-a", "agent-1", {"x": 2}, msg_id="note-1")
    d = await board.post_idea("comp1", "cand-a", "agent-1", {"x": 3}, msg_id="note-1")
    e = await board.post_idea("comp1", "cand-a", "agent-1", {"x": 2})  # a new idea
    assert a.seq == b.seq and c.seq == d.seq
    assert [p.seq for p in await board.history("comp1")] == [a.seq, c.seq, e.seq]


async def test_eight_concurrent_claimers_exactly_one_wins(
    nats_url: str, prefix: str, board: Board
) -> None:
    clients = [await kn.connect(nats_url, f"claimer-{i}") for i in range(8)]
    try:
        boards = [Board(c.jetstream(), prefix) for c in clients]
        results = await asyncio.gather(
            *(b.claim("comp1", "cand-x", f"agent-{i}") for i, b in enumerate(boards))
        )
        assert sum(results) == 1
        winner = f"agent-{results.index(True)}"
        assert await board.claim_holder("comp1", "cand-x") == winner
        # Retries keep the answer: the winner still holds it, a loser still does not.
        assert await boards[results.index(True)].claim("comp1", "cand-x", winner) is True
        loser = results.index(False)
        assert await boards[loser].claim("comp1", "cand-x", f"agent-{loser}") is False
        claims = await board.history("comp1", kinds=["claim"])
        assert [p.agent for p in claims] == [winner]
    finally:
        for c in clients:
            await c.close()


async def test_claims_on_different_candidates_all_succeed(board: Board) -> None:
    cands = [f"cand-{i}" for i in range(10)]
    results = await asyncio.gather(
        *(board.claim("comp1", c, f"agent-{i}") for i, c in enumerate(cands))
    )
    assert results == [True] * 10
    assert await board.claimed("comp1") == set(cands)
    assert await board.claim_holder("comp1", "cand-3") == "agent-3"
    assert await board.claim_holder("comp1", "unclaimed") is None


async def test_follow_yields_posts_published_after_it_started(board: Board) -> None:
    first = await board.post_idea("comp1", "cand-a", "agent-1")
    async with contextlib.aclosing(board.follow("comp1")) as live:
        assert await asyncio.wait_for(anext(live), 5.0) == first  # the consumer is live now
        pending = asyncio.ensure_future(anext(live))
        await asyncio.sleep(0.2)
        assert not pending.done()
        later = await board.post_idea("comp1", "cand-a", "agent-2", {"ok": True})
        got = await asyncio.wait_for(pending, 5.0)
    assert got == later
    assert isinstance(got, BoardPost) and got.seq > first.seq and got.agent == "agent-2"


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "x*", ">", "é", "a" * 129])
async def test_invalid_ids_are_refused(board: Board, bad: str) -> None:
    with pytest.raises(InvalidArgument):
        await board.post_idea(bad, "cand", "agent")
    with pytest.raises(InvalidArgument):
        await board.post_idea("comp", bad, "agent")
    with pytest.raises(InvalidArgument):
        await board.claim("comp", bad, "agent")
    if bad != "a.b":  # agents may contain dots
        with pytest.raises(InvalidArgument):
            await board.post_idea("comp", "cand", bad)
    with pytest.raises(InvalidArgument):
        await board.history(bad)
    with pytest.raises(InvalidArgument):
        await board.claimed(bad)
    with pytest.raises(InvalidArgument):
        await anext(board.follow(bad))


async def test_unknown_kind_is_refused(board: Board) -> None:
    with pytest.raises(InvalidArgument):
        await board.history("comp1", kinds=["vote"])
    with pytest.raises(InvalidArgument):
        await board.history("comp1", kinds=[])


async def test_the_board_carries_no_results(nc: Client, prefix: str, board: Board) -> None:
    """Results are the ledger's: the client has no result post, refuses the kind, and drops a
    message someone published on a result subject by hand."""
    assert not hasattr(board, "post_result")
    with pytest.raises(InvalidArgument):
        await board.history("comp1", kinds=["result"])
    with pytest.raises(InvalidArgument):
        await anext(board.follow("comp1", kinds=["result"]))
    stray = BoardPost(kind="idea", compilation_id="comp1", candidate_id="cand-a", agent="x")
    await nc.jetstream().publish(f"{prefix}.board.comp1.result.cand-a", stray.to_json())
    idea = await board.post_idea("comp1", "cand-a", "agent-1")
    assert await board.history("comp1") == [idea]
