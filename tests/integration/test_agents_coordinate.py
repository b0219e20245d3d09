"""All four default agent kinds on one compilation through the real NATS board.

The only stand-in is the Lab (the runner's side: experiment budget, measurement and the
result feed it judges each measurement into): it measures a candidate instantly with a
deterministic synthetic speed function. Everything else is real: the board (NATS JetStream:
ideas, claims exclusive per candidate), the agents' shared loop, their views, and the optuna
agent's study in PostgreSQL (its own schema; in memory when no PostgreSQL answers).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import sqlalchemy

from kiln.agent_runner.agents import DEFAULT_AGENTS, Lab, Outcome, build_agents
from kiln.agent_runner.agents.combiner import CombinerAgent
from kiln.agent_runner.agents.optuna_search import open_storage, resolve_storage
from kiln.agent_runner.budget import ExperimentBudget
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.op_roofline import bandwidth_bytes_per_s, op_bytes, roofline_ms
from kiln.agent_runner.results import ResultFeed, SearchResult, result_body
from kiln.agent_runner.space import CandidateSpace, Dimension
from kiln.board import Board
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.events.types import ExperimentCompleted
from kiln.workloads.config import parse_config

pytestmark = pytest.mark.integration

MODEL = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
PG = os.environ.get("KILN_TEST_OPTUNA_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SHAPE = {"layers": 2, "batch_size": 8, "context_len": 1024, "dtype_bytes": 2}
SPACE = CandidateSpace(
    [
        Dimension("threads", (None, "2", "4")),
        Dimension("op:attention", (None, "sdpa", "flash")),
        Dimension("op:mlp", (None, "fused_gate_up")),
        Dimension("op:rope", (None, "cos_sin_cache")),
        Dimension("op:qkv_proj", (None, "fused")),
    ]
)
GAPS = {"attention": 0.9, "mlp": 0.4, "rope": 0.2, "qkv_proj": 0.1, "lm_head": 0.05}
"""The reference's ms above the roofline per op: attention has the largest gap."""
CUTS = {"sdpa": 0.5, "flash": 0.3, "fused_gate_up": 0.5, "cos_sin_cache": 0.5, "fused": 0.6}
"""Factor on its op's gap when an alternative is bound."""
OVERHEAD_MS = {None: 0.5, "2": 0.4, "4": 0.3}
"""Per-step overhead by threads setting."""
BUDGET = 30


def _synthetic(candidate: Candidate, floor: dict[str, float]) -> tuple[float, dict[str, float]]:
    """tokens/s and the per-op profile of ``candidate`` (deterministic)."""
    point = SPACE.assignment(candidate)
    op_ms = {}
    for op, gap in GAPS.items():
        impl = point.get(f"op:{op}")
        op_ms[op] = floor[op] + gap * (CUTS[impl] if impl else 1.0)
    step_ms = sum(op_ms.values()) + OVERHEAD_MS[point["threads"]]
    return SHAPE["batch_size"] / (step_ms / 1e3), op_ms


class SyntheticLab:
    """The runner's side of the agents (the test's only stand-in): an experiment budget, no
    candidate measured twice, an instant synthetic measurement, and its result in the feed."""

    def __init__(self, board: Board, compilation_id: str, workload: Any, floor: dict) -> None:
        self.compilation_id, self.space, self.board = compilation_id, SPACE, board
        self.results = ResultFeed(compilation_id)
        self.workload = workload
        self.budget = ExperimentBudget(limit=BUDGET)
        self.floor = floor
        self.measured: list[tuple[str, str, bool]] = []
        self.requested: set[str] = set()

    def reserve(self) -> bool:
        return self.budget.reserve()

    async def acquire(self) -> bool:
        return await self.budget.acquire()

    def release(self) -> None:
        self.budget.release()

    async def measure(
        self, candidate: Candidate, agent: str, *, profile: bool = False
    ) -> Outcome | None:
        if candidate.id in self.requested:
            self.release()
            return None
        self.requested.add(candidate.id)
        await asyncio.sleep(0.1)  # an engine takes a while: every agent gets turns
        tps, op_ms = _synthetic(candidate, self.floor)
        self.measured.append((agent, candidate.id, profile))
        self.budget.complete()
        result = ExperimentCompleted(
            compilation_id=self.compilation_id,
            candidate_id=candidate.id,
            status="ok",
            correct=True,
            median_ms=SHAPE["batch_size"] / tps * 1e3,
            tokens_per_s=tps,
            tier="fast",
            op_ms=op_ms if profile else {},
            op_profile_shape=SHAPE if profile else {},
        )
        eid = uuid.uuid4().hex
        completed = Completed(eid, result, 1, datetime.now(UTC))
        base, _ = _synthetic(REFERENCE_CANDIDATE, self.floor)
        req = Requested(eid, self.compilation_id, "t", candidate, agent, "fast", 1, profile)
        self.results.take(req, completed, tps / base)
        return Outcome(eid, candidate, completed, tps / base)


@pytest.fixture
def optuna_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The optuna agent's storage: PostgreSQL in a schema of its own (dropped afterwards)."""
    schema = f"optuna_t{uuid.uuid4().hex[:10]}"
    engine = sqlalchemy.create_engine(PG)
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT 1"))
    except sqlalchemy.exc.OperationalError:
        monkeypatch.setenv("KILN_OPTUNA_STORAGE", "memory")
        yield "memory"
        return
    monkeypatch.setenv("KILN_OPTUNA_STORAGE", PG)
    monkeypatch.setenv("KILN_OPTUNA_DB_SCHEMA", schema)
    try:
        # its tables made now (the storage is kept per process), so creating them does not
        # hold the optuna agent back while the others spend the budget
        open_storage(resolve_storage(), schema)
        yield schema
    finally:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()


@pytest.mark.skipif(not MODEL.is_dir(), reason="../shared/data/models is not here")
async def test_four_agents_share_one_board_without_duplicate_claims(
    nc: Any, prefix: str, optuna_env: str
) -> None:
    board = Board(nc.jetstream(), prefix)
    cid = f"coord{uuid.uuid4().hex[:8]}"
    config_text = (MODEL / "llama-3.2-1b.json").read_text()
    config = parse_config(json.loads(config_text), "llama-3.2-1b")
    bw, _ = bandwidth_bytes_per_s("h200")
    floor = roofline_ms(op_bytes(config, **SHAPE), bw)
    workload = SimpleNamespace(
        model=SimpleNamespace(config_json=config_text, name="llama-3.2-1b"),
        hardware=SimpleNamespace(name="h200"),
    )
    lab = SyntheticLab(board, cid, workload, floor)

    # The runner's baseline: the reference claimed, measured (profiled) and judged into the
    # result feed before agents start.
    base_tps, base_ops = _synthetic(REFERENCE_CANDIDATE, floor)
    assert await board.claim(cid, REFERENCE_CANDIDATE.id, "baseline")
    summary = {
        "status": "ok",
        "correct": True,
        "tokens_per_s": base_tps,
        "op_ms": base_ops,
        "op_profile_shape": SHAPE,
    }
    lab.results.add(
        SearchResult(
            REFERENCE_CANDIDATE,
            base_tps,
            True,
            "baseline",
            base_ops,
            SHAPE,
            experiment_id="baseline-exp",
            body=result_body(REFERENCE_CANDIDATE, summary, 1.0),
        )
    )

    agents = build_agents(list(DEFAULT_AGENTS), cid)
    assert sorted(a.kind for a in agents) == ["combiner", "coordinate", "optuna", "profiler"]
    for agent in agents:
        if isinstance(agent, CombinerAgent):
            agent.quiet_s = 5.0
    counts = await asyncio.wait_for(asyncio.gather(*(a.run(cast(Lab, lab)) for a in agents)), 120)

    # No candidate claimed twice on the board; every agent measured something.
    claims = await board.history(cid, kinds=["claim"])
    ids = [p.candidate_id for p in claims]
    assert len(ids) == len(set(ids))
    assert Counter(p.agent for p in claims)["baseline"] == 1
    measured = [c for _, c, _ in lab.measured]
    assert len(measured) == len(set(measured)) == BUDGET == sum(counts)
    assert all(n > 0 for n in counts), dict(zip([a.name for a in agents], counts, strict=True))
    # Only the profiler asks for profiles.
    assert {a for a, _, p in lab.measured if p} == {"profiler"}

    ideas = await board.history(cid, kinds=["idea"])
    # The profiler's first proposal targets the op with the largest synthetic gap.
    first = next(p for p in ideas if p.agent == "profiler")
    assert first.body["why"].startswith("op attention: measured ")
    assert ": op:attention -> " in first.body["why"]
    assert dict(Candidate.from_canonical(first.body["candidate"]).ops)["attention"] != "reference"

    # The combiner proposed a composition of moves other agents measured.
    combos = [p for p in ideas if p.agent == "combiner"]
    assert combos and combos[0].body["why"].startswith("composes ")
    composed = Candidate.from_canonical(combos[0].body["candidate"])
    results = list(lab.results)
    assert all(p.kind in ("idea", "claim") for p in await board.history(cid))  # no results
    assert {r.candidate.id for r in results} == {*measured, REFERENCE_CANDIDATE.id}
    before = next(i for i, r in enumerate(results) if r.candidate == composed)
    point = SPACE.assignment(composed)
    moves = [d for d in SPACE.dims if point[d.name] is not None]
    assert len(moves) >= 2
    for d in moves:  # each move was measured by another agent first
        assert any(
            r.agent not in ("combiner", "baseline")
            and SPACE.assignment(r.candidate)[d.name] == point[d.name]
            for r in results[:before]
        ), d.name
