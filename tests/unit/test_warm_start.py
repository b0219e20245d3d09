"""The pure rules of warm starts: the incumbent verdict, the reuse key and agreement, the prior
trials told to optuna and the fold of ``MeasurementReused`` (the runner's phases, resumed after a
restart too, are in tests/integration/test_warm_start_grpc.py)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from kiln.agent_runner.incumbent import decide
from kiln.agent_runner.seeding import first_measured, prior_trials, seed_candidates
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, Transform
from kiln.domain.reuse import agrees, reuse_key, reused_record
from kiln.events.types import ExperimentCompleted

SDPA = Candidate.make({"attention": "sdpa"})
THREADS = Candidate.make(transforms=[Transform.of("threads", n=2)])


def _workload(**traffic: object) -> dict[str, object]:
    return {
        "model": {"config_json": json.dumps({"hidden_size": 8, "torch_dtype": "float32"})},
        "traffic": {"batch_size": 8, "context_len": 512, **traffic},
        "hardware": {"name": "cpu"},
    }


def _done(**kw: object) -> ExperimentCompleted:
    base: dict[str, object] = {
        "compilation_id": "c",
        "candidate_id": "x",
        "status": "ok",
        "correct": True,
        "tokens_per_s": 100.0,
        "tier": "fast",
        "batch_size": 8,
        "context_len": 512,
        "environment": {"kiln": "1", "torch": "2"},
        "weights_bytes": 10,
        "kv_cache_bytes": 20,
    }
    return ExperimentCompleted.model_validate(base | kw)


def test_the_challenger_wins_only_beyond_the_noise() -> None:
    v = decide([100.0, 101.0, 99.0], [110.0, 111.0, 109.0], margin=0.02)
    assert v.better and v.gain == pytest.approx(0.10)
    assert v.noise == pytest.approx(0.02)  # the spreads (2 %, 1.8 %) are within the margin
    noisy = decide([90.0, 100.0, 110.0], [110.0, 111.0, 109.0], margin=0.02)
    assert not noisy.better and noisy.noise == pytest.approx(0.2)  # gain 10 % < spread 20 %
    slower = decide([100.0], [99.0], margin=0.02)
    assert not slower.better and "below" not in slower.reason  # -1 %: within the noise
    assert not decide([100.0], [], margin=0.02).better
    assert decide([], [50.0], margin=0.02).better  # the incumbent does not run correctly here


def test_the_reuse_key_is_the_operating_point_not_the_whole_shape() -> None:
    key = reuse_key(_workload(), "fast")
    assert key.startswith("rk-")
    assert reuse_key(_workload(arrival_rate=3.0), "fast") == key  # not read by an engine
    assert reuse_key(_workload(batch_size=2), "fast") != key
    assert reuse_key(_workload(), "full") != key
    seeded = _workload()
    seeded["model"] = {**seeded["model"], "seed": 7}  # type: ignore[dict-item]
    assert reuse_key(seeded, "fast") != key


def test_an_earlier_measurement_agrees_only_with_the_same_engine_and_reference() -> None:
    ref = _done()
    assert agrees(_done(), ref, reference_of_earlier=ref) is None
    assert "environment" in (
        agrees(_done(environment={"kiln": "2"}), ref, reference_of_earlier=ref) or ""
    )
    assert "batch_size" in (agrees(_done(batch_size=4), ref, reference_of_earlier=ref) or "")
    assert "weights_bytes" in (
        agrees(_done(), ref, reference_of_earlier=_done(weights_bytes=11)) or ""
    )
    wrong = _done(status="incorrect", correct=False, tokens_per_s=0.0)
    assert agrees(wrong, ref, reference_of_earlier=ref) == "not a correct measurement"


def test_seeds_beyond_those_measured_become_prior_trials_at_this_scale() -> None:
    seeds = [
        {"candidate_id": SDPA.id, "candidate": SDPA.canonical(), "speedup": 1.5},
        {"candidate_id": "f" * 24, "candidate": THREADS.canonical(), "speedup": 2.0},  # bad id
        {"candidate_id": THREADS.id, "candidate": THREADS.canonical(), "speedup": 1.2},
        {"candidate_id": REFERENCE_CANDIDATE.id, "candidate": REFERENCE_CANDIDATE.canonical()},
    ]
    assert [c.id for c, _ in seed_candidates(seeds)] == [SDPA.id, THREADS.id]
    assert prior_trials(seeds, [SDPA], 200.0) == [(THREADS, pytest.approx(240.0))]
    assert prior_trials(seeds, [], 0.0) == []  # no reference measured here yet


def _seed(candidate: Candidate, source: str, speedup: float, lost: bool = False) -> dict:
    return {
        "candidate_id": candidate.id,
        "candidate": candidate.canonical(),
        "source": source,
        "speedup": speedup,
        "lost_on_full_tier": lost,
    }


def test_only_proven_seeds_are_measured_first() -> None:
    compiled = Candidate.make(transforms=[Transform.of("torch_compile", mode="default")])
    fused = Candidate.make({"mlp": "fused_gate_up"})
    seeds = [
        _seed(SDPA, "winner", 0.9),  # a winner is proven whatever its number
        _seed(compiled, "measured", 1.8, lost=True),  # confirmed by its source and wanting
        _seed(fused, "measured", 0.95),  # slower than its own reference
        _seed(THREADS, "measured", 1.3),
    ]
    assert first_measured(seeds, 4) == [SDPA, THREADS]
    assert first_measured(seeds, 1) == [SDPA]
    # an engine's refusal passes over a seed to the next proven one
    assert first_measured(seeds, 1, lambda c: "no" if c == SDPA else None) == [THREADS]
    # a source with no winner and nothing that held up costs no experiment; all inform TPE
    nothing = seeds[1:3]
    assert first_measured(nothing, 4) == []
    assert [c for c, _ in prior_trials(nothing, [], 100.0)] == [compiled, fused]


def test_a_reused_measurement_folds_into_the_original_experiment() -> None:
    at = datetime(2026, 1, 1, tzinfo=UTC)
    payload = {
        "experiment_id": "e1",
        "source_compilation_id": "old",
        "candidate_id": SDPA.id,
        "candidate": SDPA.canonical(),
        "agent": "warm",
        "tier": "fast",
        "reuse_key": "rk-1",
        "result": _done().model_dump(mode="json"),
    }
    rec = reused_record(payload, 42, at, "t")
    assert rec.requested.experiment_id == "e1" and rec.requested.compilation_id == "old"
    assert rec.completed is not None and rec.completed.ok and rec.completed.position == 42
    with pytest.raises(ValueError):
        reused_record({**payload, "candidate_id": THREADS.id}, 42, at, "t")
