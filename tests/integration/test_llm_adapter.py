"""The code-writing agent against a real HTTP server on 127.0.0.1 and a real NATS board.

The only stand-in is the LLM itself: a stdlib ``http.server`` in a thread that answers
``POST /v1/chat/completions`` with fixed OpenAI-format completions and records every request.
The code module the agent proposes is then loaded for real (``load_code_modules``) and compared
with the reference implementation.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast

import pytest
import torch
from nats.aio.client import Client

import kiln.ops  # noqa: F401  (registers the built-in implementations)
from kiln.agent_runner.agents import Lab, Outcome, build_agents, validate_agents
from kiln.agent_runner.agents.llm import LLMAgent
from kiln.agent_runner.agents.registry import DEFAULT_AGENTS
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.budget import ExperimentBudget
from kiln.agent_runner.config import LLMSettings
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.llm import ChatClient, LLMReplyError, LLMRequestError, LLMUnavailable
from kiln.agent_runner.results import ResultFeed, SearchResult, result_body
from kiln.agent_runner.space import CandidateSpace, space_for
from kiln.board import Board
from kiln.common.errors import InvalidArgument
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.events.types import ExperimentCompleted
from kiln.ops import registry
from kiln.runtime.reload import RegistrySnapshot, forget_sources, load_code_modules
from kiln.v1 import common_pb2

pytestmark = pytest.mark.integration

RMS_NORM_MODULE = """\
import torch

from kiln.ops.registry import register


@register("rms_norm", "llm_one_pass", replace=True)
def llm_one_pass(x, residual=None, *, weight, eps):
    if residual is not None:
        x = x + residual
    h = x.float()
    inv = torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps)
    return weight * (h * inv).to(x.dtype), x
"""
EXPLANATION = "One reduction with h*h instead of pow, and the residual add kept in place."
GOOD = f"{EXPLANATION}\n\n```python\n{RMS_NORM_MODULE}```\n"


def chat_reply(content: str) -> dict[str, Any]:
    """An OpenAI Chat Completions response body with one choice."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "fixed-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30},
    }


@dataclass
class FixedLLM:
    """Answers with ``script`` in order (the last answer repeats); records requests."""

    script: list[tuple[int, bytes]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""

    def answer(self, status: int, body: dict[str, Any] | str) -> None:
        data = body if isinstance(body, str) else json.dumps(body)
        self.script.append((status, data.encode()))

    def reply_with(self, *contents: str) -> None:
        for c in contents:
            self.answer(200, chat_reply(c))

    def bodies(self) -> list[dict[str, Any]]:
        return [r["json"] for r in self.requests]


@pytest.fixture
def llm() -> Iterator[FixedLLM]:
    fixed = FixedLLM()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                fixed.requests.append(
                    {"path": self.path, "headers": dict(self.headers), "json": json.loads(raw)}
                )
                n = len(fixed.requests)
                status, body = fixed.script[min(n, len(fixed.script)) - 1]
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # a free loopback port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    fixed.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        yield fixed
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def settings(llm: FixedLLM, **kw: Any) -> LLMSettings:
    return LLMSettings(url=llm.url, model="fixed-model", backoff_s=0.01, **kw)


@pytest.fixture
def board(nc: Client, prefix: str) -> Board:
    return Board(nc.jetstream(), prefix)


class OneSpaceLab:
    """The parts of a :class:`Lab` that ``next_proposal`` reads: the board, the result feed,
    the space, the workload facts and whether an experiment slot is left (``slots``)."""

    def __init__(self, board: Board, space: CandidateSpace, cid: str = "comp-llm") -> None:
        self.compilation_id, self.board, self.space = cid, board, space
        self.results = ResultFeed(cid)
        self.workload = common_pb2.Workload(
            model=common_pb2.ModelSpec(name="tiny-llama", dtype="float32"),
            traffic=common_pb2.TrafficShape(batch_size=4, context_len=256),
            hardware=common_pb2.HardwareTarget(name="cpu"),
        )
        self.slots = 1

    def reserve(self) -> bool:
        if self.slots <= 0:
            return False
        self.slots -= 1
        return True

    async def acquire(self) -> bool:
        return self.reserve()

    def release(self) -> None:
        self.slots += 1


def rms_norm_only() -> CandidateSpace:
    space = space_for("cpu", cpus=2)
    return space.without_ops(frozenset(d.op for d in space.dims if d.op not in (None, "rms_norm")))


def matches_reference(candidate: Candidate, impl: str) -> bool:
    """Load the candidate's code modules for real, run ``rms_norm``'s ``impl`` against the
    reference on random input (with and without a residual), then restore the registry."""
    snapshot = RegistrySnapshot.take()
    try:
        load_code_modules(candidate.code_modules)
        mine, ref = registry.get("rms_norm", impl), registry.get("rms_norm")
        gen = torch.Generator().manual_seed(7)
        x, res = (torch.randn(3, 5, 64, generator=gen) for _ in range(2))
        w, eps = torch.rand(64, generator=gen) + 0.5, 1e-5
        same = True
        for residual in (None, res):
            got, want = mine(x, residual, weight=w, eps=eps), ref(x, residual, weight=w, eps=eps)
            same &= all(
                torch.allclose(g, r, atol=1e-5, rtol=1e-5) for g, r in zip(got, want, strict=True)
            )
        return same
    finally:
        forget_sources(candidate.code_modules)
        assert snapshot.restore()
        assert not snapshot.changed()


async def test_round_trip_completion_becomes_a_candidate_whose_module_matches_the_reference(
    llm: FixedLLM, board: Board
) -> None:
    llm.reply_with(GOOD)
    lab = OneSpaceLab(board, rms_norm_only())
    fast = Candidate.make({}, [space_for("cpu", cpus=2).candidate({"threads": "2"}).transforms[0]])
    for c, tps in ((REFERENCE_CANDIDATE, 100.0), (fast, 140.0)):
        summary = {"status": "ok", "correct": True, "tokens_per_s": tps}
        body = result_body(c, summary, 1.0)
        lab.results.add(
            SearchResult(c, tps, True, "baseline", experiment_id=f"exp-{c.id}", body=body)
        )
    agent = LLMAgent("llm", 1, settings(llm, api_key="sk-test"))
    view = BoardView(board, lab.compilation_id, lab.results)
    await view.start()
    try:
        proposal = await agent.next_proposal(view, cast(Lab, lab))
    finally:
        await view.close()
        await agent.client().close()

    [request] = llm.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer sk-test"
    sent = request["json"]
    assert sent["model"] == "fixed-model" and sent["max_tokens"] == 4096
    assert sent["temperature"] == pytest.approx(0.2)
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    user = sent["messages"][1]["content"]
    assert "def reference(" in user and "torch.rsqrt" in user  # the reference's source
    assert "140 tokens/s" in user and "hardware cpu; model tiny-llama" in user

    assert proposal is not None
    c = proposal.candidate
    assert dict(c.ops) == {"rms_norm": "llm_one_pass"}
    assert c.transforms == fast.transforms  # built on the best result so far
    [module] = c.code_modules
    assert module.name.startswith("llm_rms_norm_") and module.source == RMS_NORM_MODULE
    assert EXPLANATION in proposal.why and "fixed-model" in proposal.why
    assert "llm_one_pass" not in registry.implementations("rms_norm")
    assert matches_reference(c, "llm_one_pass")
    assert "llm_one_pass" not in registry.implementations("rms_norm")


async def test_5xx_and_429_are_retried_then_the_completion_returns(llm: FixedLLM) -> None:
    llm.answer(500, "upstream down")
    llm.answer(429, {"error": "slow down"})
    llm.reply_with("hello")
    async with ChatClient(llm.url, "m", attempts=3, backoff_s=0.01) as client:
        completion = await client.complete([{"role": "user", "content": "hi"}])
    assert completion.text == "hello" and completion.completion_tokens == 20
    assert len(llm.requests) == 3 and "Authorization" not in llm.requests[0]["headers"]


async def test_errors_are_clear_and_bounded(llm: FixedLLM) -> None:
    llm.answer(503, "still down")
    async with ChatClient(llm.url, "m", attempts=2, backoff_s=0.01) as client:
        with pytest.raises(LLMUnavailable, match=r"failed 2 time\(s\); last: HTTP 503: still down"):
            await client.complete([{"role": "user", "content": "hi"}])
    assert len(llm.requests) == 2
    llm.script[:] = [(401, b'{"error": "bad key"}')]
    llm.requests.clear()
    async with ChatClient(llm.url, "m", attempts=3, backoff_s=0.01) as client:
        with pytest.raises(LLMRequestError, match="HTTP 401"):
            await client.complete([])
        assert len(llm.requests) == 1  # a 4xx is not retried
        llm.script[:] = [(200, b"<html>not json</html>")]
        with pytest.raises(LLMReplyError, match="non-JSON"):
            await client.complete([])
        llm.script[:] = [(200, b'{"choices": []}')]
        with pytest.raises(LLMReplyError, match="no choices"):
            await client.complete([])


async def test_connection_refused_is_retried_then_unavailable() -> None:
    client = ChatClient("http://127.0.0.1:9/v1", "m", attempts=2, backoff_s=0.01)
    async with client:
        with pytest.raises(LLMUnavailable, match="failed 2 time"):
            await client.complete([])


async def test_garbage_completions_give_no_candidate_notes_on_the_board_and_a_stop(
    llm: FixedLLM, board: Board
) -> None:
    llm.reply_with("I would rather not.", GOOD.replace('"rms_norm", "llm', '"mlp", "llm'))
    lab = OneSpaceLab(board, rms_norm_only(), cid="comp-garbage")
    agent = LLMAgent("llm", 1, settings(llm, max_bad_replies=2))
    view = BoardView(board, lab.compilation_id, lab.results)
    await view.start()
    try:
        assert await agent.next_proposal(view, cast(Lab, lab)) is None
        assert agent.stopped and agent.bad_in_row == 2
        assert await agent.next_proposal(view, cast(Lab, lab)) is None  # stays stopped
    finally:
        await view.close()
        await agent.client().close()
    assert len(llm.requests) == 2
    # The second prompt shows the LLM why its first reply was rejected.
    second = llm.bodies()[1]["messages"][1]["content"]
    assert "[your reply rejected] rms_norm: the reply has no ```python block" in second
    notes = await board.history(lab.compilation_id, kinds=["idea"])
    assert [n.body["reason"] for n in notes] == [
        "the reply has no ```python block and is not Python source either",
        "the module registers op 'mlp', but 'rms_norm' was asked for",
    ]
    assert all(n.candidate_id.startswith("llm-note-") and n.agent == "llm" for n in notes)
    assert await board.history(lab.compilation_id, kinds=["claim"]) == []


async def test_no_completion_is_asked_for_once_the_budget_is_spent(
    llm: FixedLLM, board: Board
) -> None:
    llm.reply_with(GOOD)
    lab = OneSpaceLab(board, rms_norm_only(), cid="comp-spent")
    lab.slots = 0
    agent = LLMAgent("llm", 1, settings(llm))
    view = BoardView(board, lab.compilation_id, lab.results)
    await view.start()
    try:
        assert await agent.next_proposal(view, cast(Lab, lab)) is None
    finally:
        await view.close()
        await agent.client().close()
    assert llm.requests == [] and not agent.stopped and lab.slots == 0


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_LLM_URL", raising=False)
    assert "llm" not in DEFAULT_AGENTS
    for build in (
        lambda: LLMAgent("llm", 1),
        lambda: validate_agents(["coordinate", "llm"]),
        lambda: build_agents(["llm"], "c1"),
    ):
        with pytest.raises(InvalidArgument) as err:
            build()
        assert "agent 'llm' is off: set KILN_LLM_URL" in err.value.message
    assert "llm" not in validate_agents([])
    monkeypatch.setenv("KILN_LLM_URL", "http://127.0.0.1:9/v1")
    monkeypatch.setenv("KILN_LLM_MODEL", "qwen-coder")
    [agent] = build_agents(["llm"], "c1")
    assert isinstance(agent, LLMAgent) and agent.settings.model == "qwen-coder"


class MeasuringLab(OneSpaceLab):
    """Stands in for the engine pool: measures a candidate by loading its code modules in this
    process and comparing ``rms_norm`` with the reference; records what it measured."""

    def __init__(self, board: Board, space: CandidateSpace, limit: int) -> None:
        super().__init__(board, space, cid="comp-run")
        self.budget = ExperimentBudget(limit=limit)
        self.measured: list[tuple[Candidate, bool]] = []

    def reserve(self) -> bool:
        return self.budget.reserve()

    async def acquire(self) -> bool:
        return await self.budget.acquire()

    def release(self) -> None:
        self.budget.release()

    async def measure(self, candidate: Candidate, agent: str, *, profile: bool = False) -> Outcome:
        impl = dict(candidate.ops)["rms_norm"]
        correct = matches_reference(candidate, impl)
        self.measured.append((candidate, correct))
        self.budget.complete()
        result = ExperimentCompleted(
            compilation_id=self.compilation_id,
            candidate_id=candidate.id,
            status="ok" if correct else "incorrect",
            correct=correct,
            max_abs_error=0.0,
            median_ms=1.0,
            p10_ms=1.0,
            p90_ms=1.0,
            tokens_per_s=120.0,
            memory_bytes=0,
            engine_id="in-test",
            tier="fast",
            error="",
        )
        eid = f"exp{len(self.measured)}"
        completed = Completed(eid, result, 1, datetime.now(UTC))
        req = Requested(eid, self.compilation_id, "t", candidate, agent, "fast", 1, profile)
        self.results.take(req, completed, 1.2)  # judged into the feed, as the runner's lab does
        return Outcome(eid, candidate, completed, 1.2)


async def test_agent_run_proposes_claims_and_measures_through_the_board(
    llm: FixedLLM, board: Board
) -> None:
    llm.reply_with(GOOD)
    lab = MeasuringLab(board, space_for("cpu", cpus=2), limit=1)
    profile = {"rms_norm": 5.0, "mlp": 1.0, "attention": 0.5}
    summary = {"status": "ok", "correct": True, "tokens_per_s": 100.0, "op_ms": profile}
    body = result_body(REFERENCE_CANDIDATE, summary, 1.0)
    lab.results.add(
        SearchResult(
            REFERENCE_CANDIDATE,
            100.0,
            True,
            "baseline",
            profile,
            experiment_id="exp-base",
            body=body,
        )
    )
    agent = LLMAgent("llm", 1, settings(llm))
    measured = await asyncio.wait_for(agent.run(cast(Lab, lab)), 30)

    assert measured == 1 and len(llm.requests) == 1  # none asked once the budget was spent
    [(candidate, correct)] = lab.measured
    assert correct and dict(candidate.ops) == {"rms_norm": "llm_one_pass"}
    # The profile made rms_norm (5 ms of 6.5) the target.
    assert "Op: rms_norm" in llm.bodies()[0]["messages"][1]["content"]
    cid = lab.compilation_id
    [claim] = await board.history(cid, kinds=["claim"])
    [idea] = await board.history(cid, kinds=["idea"])
    assert len(await board.history(cid)) == 2  # ideas and claims only: no result on the board
    assert claim.candidate_id == idea.candidate_id == candidate.id and claim.agent == "llm"
    assert EXPLANATION in idea.body["why"]
    mine = [r for r in lab.results if r.agent == "llm"]
    assert len(mine) == 1 and mine[0].body["status"] == "ok" and mine[0].body["speedup"] == 1.2
    assert agent._client is None  # the client it built is closed at the end
