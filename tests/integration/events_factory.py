"""Realistic event sequences for ledger tests (valid against kiln.events.types)."""

from __future__ import annotations

import random
import uuid

from kiln.ledger.model import NewEvent


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def submitted(workload_key: str = "wk-llama-h200") -> NewEvent:
    """CompilationSubmitted (its id is the stream's, its team the appending call's)."""
    return NewEvent(
        "CompilationSubmitted",
        {
            "workload_key": workload_key,
            "model_name": "llama-3.2-1b",
            "hardware": "h200",
            "workload": {"model": {"name": "llama-3.2-1b"}},
            "budget": {"wall_seconds": 300, "max_experiments": 40},
            "agents": ["searcher", "profiler"],
        },
    )


def requested(compilation_id: str, experiment_id: str, candidate_id: str) -> NewEvent:
    return NewEvent(
        "ExperimentRequested",
        {
            "compilation_id": compilation_id,
            "candidate_id": candidate_id,
            "candidate": {"ops": {"attention": "sdpa"}},
            "tier": "fast",
            "agent": "searcher",
        },
    )


def completed(
    compilation_id: str, experiment_id: str, candidate_id: str, tps: float, ok: bool = True
) -> NewEvent:
    return NewEvent(
        "ExperimentCompleted",
        {
            "compilation_id": compilation_id,
            "candidate_id": candidate_id,
            "status": "ok" if ok else "crashed",
            "correct": ok,
            "median_ms": 1000.0 / tps if ok else 0.0,
            "tokens_per_s": tps if ok else 0.0,
            "tier": "fast",
            "engine_id": "engine-0",
            "error": "" if ok else "segfault",
        },
    )


def best(
    workload_key: str, experiment_id: str, candidate_id: str, tps: float, speedup: float
) -> NewEvent:
    return NewEvent(
        "BestCandidateImproved",
        {
            "workload_key": workload_key,
            "experiment_id": experiment_id,
            "candidate_id": candidate_id,
            "tokens_per_s": tps,
            "median_ms": 1000.0 / tps,
            "speedup": speedup,
            "tier": "full",
        },
    )


def compilation_story(
    rng: random.Random, compilation_id: str, workload_key: str, n_experiments: int
) -> list[tuple[str, list[NewEvent]]]:
    """(stream id, events) appends that tell one compilation's life in order."""
    out: list[tuple[str, list[NewEvent]]] = [
        (f"compilation-{compilation_id}", [submitted(workload_key)])
    ]
    baseline = 100.0
    best_tps = baseline
    out.append(
        (
            f"compilation-{compilation_id}",
            [
                NewEvent("CompilationPlanned", {"plan": {"tp": 1}}),
                NewEvent(
                    "BaselineMeasured",
                    {
                        "experiment_id": "base",
                        "candidate_id": "ref",
                        "tokens_per_s": baseline,
                        "median_ms": 10.0,
                    },
                ),
            ],
        )
    )
    for _ in range(n_experiments):
        exp, cand = new_id(), new_id()
        tps = rng.uniform(50, 300)
        ok = rng.random() > 0.2
        out.append(
            (
                f"experiment-{exp}",
                [
                    requested(compilation_id, exp, cand),
                    completed(compilation_id, exp, cand, tps, ok),
                ],
            )
        )
        if ok and tps > best_tps:
            best_tps = tps
            out.append(
                (
                    f"compilation-{compilation_id}",
                    [best(workload_key, exp, cand, tps, tps / baseline)],
                )
            )
    out.append(
        (f"compilation-{compilation_id}", [NewEvent("CompilationEnded", {"status": "succeeded"})])
    )
    return out
