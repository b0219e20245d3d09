"""The search results a compilation's agents see, taken from the runner's fold of the ledger.

A :class:`ResultFeed` holds one :class:`SearchResult` per search-tier experiment of one
compilation (the baseline's included; full-tier confirmations and the baseline comparisons,
agents ``compare:*``, are not results agents search from). It is fed in one place, the lab's
judgement of each completion (:meth:`kiln.agent_runner.lab.CompilationLab.judge`), and, on a
resumed compilation, from the experiments completed before the restart (:meth:`fill`). It is
idempotent by experiment id and tells its listeners (the agents' views) of each new result
synchronously, on the runner's event loop. The board carries ideas and claims only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.agent_runner.judge import speedup as speedup_of
from kiln.agent_runner.state import CompilationState
from kiln.domain import judging
from kiln.domain.baselines import COMPARE_AGENT_PREFIX
from kiln.domain.candidate import Candidate
from kiln.domain.experiment import Completed, Requested
from kiln.domain.judging import SEARCH_TIER

__all__ = ["ResultFeed", "SearchResult", "Seen", "result_body"]


def result_body(candidate: Candidate, summary: dict[str, Any], speedup: float | None) -> dict:
    """A result as the agents' history shows it: the candidate's recipe, the measurement
    summary (status, correct, tokens_per_s, median_ms, op_ms, ...) and the speedup over the
    baseline (None if unknown)."""
    return {"candidate": candidate.canonical(), **summary, "speedup": speedup}


@dataclass(frozen=True)
class Seen:
    """A result as an agent sees it: the candidate, tokens/s (0 when it did not run), whether it
    was measured correct (status ok and correct), the agent that requested it (``baseline`` for
    the reference), and its per-op profile when it has one (``op_ms``: op name -> ms per decode
    step summed over layers; ``op_profile_shape``: layers, batch_size, context_len, dtype_bytes;
    both empty when not profiled)."""

    candidate: Candidate
    tokens_per_s: float
    ok: bool
    agent: str
    op_ms: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    op_profile_shape: dict[str, int] = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True, kw_only=True)
class SearchResult(Seen):
    """One search-tier experiment's result: what agents see (:class:`Seen`), its
    ``experiment_id`` and its ``body`` (:func:`result_body`; not compared)."""

    experiment_id: str
    body: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @staticmethod
    def of(req: Requested, completed: Completed, speedup: float | None) -> SearchResult:
        """The result of a completed experiment, with its speedup over the baseline."""
        r = completed.result
        return SearchResult(
            candidate=req.candidate,
            tokens_per_s=r.tokens_per_s,
            ok=completed.ok,
            agent=req.agent,
            op_ms=dict(r.op_ms),
            op_profile_shape=dict(r.op_profile_shape),
            experiment_id=req.experiment_id,
            body=result_body(req.candidate, completed.summary(), speedup),
        )


def is_search_result(req: Requested) -> bool:
    """Whether an experiment's result belongs in the feed: search tier, not a comparison."""
    return req.tier == SEARCH_TIER and not req.baseline and not is_compare(req.agent)


def is_compare(agent: str) -> bool:
    """Whether ``agent`` names a baseline comparison (``compare:<name>``)."""
    return agent.startswith(COMPARE_AGENT_PREFIX)


Listener = Callable[[SearchResult], None]


class ResultFeed:
    """The search results of one compilation, in the order they were judged.

    Args:
        compilation_id: the compilation.
    """

    def __init__(self, compilation_id: str) -> None:
        self.compilation_id = compilation_id
        self._results: dict[str, SearchResult] = {}
        self._listeners: list[Listener] = []

    def __iter__(self) -> Iterator[SearchResult]:
        return iter(list(self._results.values()))

    def __len__(self) -> int:
        return len(self._results)

    def bodies(self) -> list[dict[str, Any]]:
        """Every result's body, oldest first."""
        return [r.body for r in self._results.values()]

    def add(self, result: SearchResult) -> bool:
        """Keep ``result`` and tell the listeners; False (nothing changes) when its experiment
        is already in the feed."""
        if result.experiment_id in self._results:
            return False
        self._results[result.experiment_id] = result
        for listener in list(self._listeners):
            listener(result)
        return True

    def take(self, req: Requested, completed: Completed, speedup: float | None) -> bool:
        """Add a judged experiment if it is a search result (:func:`is_search_result`);
        False when it is not one or is already in the feed."""
        if not is_search_result(req):
            return False
        return self.add(SearchResult.of(req, completed, speedup))

    def fill(self, state: CompilationState) -> int:
        """Add the search results ``state`` already holds (a resumed compilation's), in the
        order they completed, with their speedup over its baseline. Nothing is added while
        there is no baseline: before ``BaselineMeasured`` the only search experiment is the
        baseline's, which the runner judges (and so feeds) again. Returns how many were
        added."""
        if state.baseline is None:
            return 0
        added = 0
        for req, completed in judging.completed_on(state.experiments.values(), SEARCH_TIER):
            added += self.take(req, completed, speedup_of(state, completed))
        return added

    def listen(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with every result added from now on; returns the call that stops
        it."""
        self._listeners.append(listener)

        def stop() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return stop
