"""A warm-started compilation's first steps: its seeds measured before the agents propose, and
the rest told to the optuna study as prior trials (docs/design/warm_start.md).

The seeds are ``CompilationSubmitted.seeds`` (:mod:`kiln.agent_runner.warm_start`), best first.
Only *proven* seeds are measured first (:func:`proven`): a winner (a source's or a nearby
compilation's best, confirmed on the full tier), or a ``measured`` seed that beat its own
reference on the search tier and that its compilation did not confirm on the full tier and find
wanting. The first :attr:`~kiln.agent_runner.config.RunnerConfig.warm_measure` proven seeds
that the engine would accept are measured on the search tier (agent ``warm``) right after the
reference, each taking an experiment slot like any proposal (inside the budget; an earlier
valid measurement answers one for free, :mod:`kiln.agent_runner.reuse`), concurrently within
the compilation's in-flight limits; their results reach every agent through the result feed.
A source with no winner thus costs the new compilation no experiment: its measurements only
inform the study. After a restart the seeds already requested are not requested again (the
tracker knows them).

A seed's number was measured at its source's operating point, so it is never compared with this
compilation's numbers: :func:`prior_trials` turns the seeds not measured here into *ranking
information* for TPE -- the source's speedup over its own reference times this compilation's
fresh reference tokens/s, i.e. the tokens/s the seed would have here if speedups carried over.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kiln.agent_runner.lab import CompilationLab
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate

log = get_logger(__name__)

WARM_AGENT = "warm"
"""The agent name of seed measurements."""


def seed_candidates(seeds: list[dict[str, Any]]) -> list[tuple[Candidate, dict[str, Any]]]:
    """(candidate, seed payload) for each recorded seed whose content hashes to its id."""
    out = []
    for seed in seeds:
        try:
            candidate = Candidate.from_canonical(dict(seed["candidate"]))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if candidate.id == seed.get("candidate_id") and not candidate.is_reference:
            out.append((candidate, seed))
    return out


def proven(seed: dict[str, Any]) -> bool:
    """Whether a recorded seed may be measured first (see the module docs)."""
    if seed.get("source") in ("winner", "nearby"):
        return True
    return float(seed.get("speedup") or 0.0) > 1.0 and not seed.get("lost_on_full_tier")


def first_measured(
    seeds: list[dict[str, Any]],
    measure: int,
    refusal: Callable[[Candidate], str | None] | None = None,
) -> list[Candidate]:
    """The first ``measure`` proven seeds that ``refusal(candidate)`` (an engine's refusal
    reason or None) lets through, best first."""
    chosen: list[Candidate] = []
    for candidate, seed in seed_candidates(seeds):
        if len(chosen) >= measure:
            break
        if not proven(seed):
            continue
        reason = refusal(candidate) if refusal is not None else None
        if reason is not None:
            log.info("seed skipped: an engine would refuse it", seed=seed, reason=reason)
            continue
        chosen.append(candidate)
    return chosen


def prior_trials(
    seeds: list[dict[str, Any]], measured: list[Candidate], reference_tokens_per_s: float
) -> list[tuple[Candidate, float]]:
    """The seeds not in ``measured`` with a known speedup, as (candidate, predicted tokens/s
    here) -- see the module docs."""
    here = {c.id for c in measured}
    out = []
    for candidate, seed in seed_candidates(seeds):
        speedup = float(seed.get("speedup") or 0.0)
        if candidate.id not in here and speedup > 0 and reference_tokens_per_s > 0:
            out.append((candidate, speedup * reference_tokens_per_s))
    return out


async def measure_seeds(lab: CompilationLab, measure: int) -> int:
    """Measure the first ``measure`` proven seeds the space accepts (see the module docs);
    returns how many were measured or reused here. Also sets ``lab.prior_trials``."""
    st = lab.state
    seeds = st.compilation.seeds
    if not seeds:
        return 0
    chosen = first_measured(seeds, measure, lab.space.refusal)
    if st.baseline is not None:
        lab.prior_trials = prior_trials(seeds, chosen, st.baseline.tokens_per_s)

    async def one(candidate: Candidate) -> bool:
        if not await lab.acquire():
            return False
        return await lab.measure(candidate, WARM_AGENT) is not None

    done = await asyncio.gather(*(one(c) for c in chosen))
    log.info("seeds measured", compilation=st.compilation_id, seeds=len(chosen), new=sum(done))
    return sum(done)
