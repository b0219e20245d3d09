"""The serving model (kiln.cost_model.serving) on step times whose answers can be worked out by
hand: a lone user, chunked prefill, prefill interference, Little's law."""

from __future__ import annotations

import pytest

from kiln.cost_model import serving
from kiln.cost_model.serving import StepTimes, simulate


def _times(fixed: float = 1.0, per_seq: float = 0.1, per_prompt_token: float = 0.01) -> StepTimes:
    """fixed ms a step + 0.1 ms a running sequence, or 0.01 ms a prompt token, whichever is more."""
    return StepTimes(fixed, lambda n: per_seq * n, lambda t: per_prompt_token * t)


def test_a_lone_user_waits_one_prefill_then_one_step_a_token() -> None:
    stats = simulate(_times(), concurrency=1, isl=100, osl=10)
    assert stats.ttft_p50_ms == pytest.approx(1.0 + 1.0)  # fixed + 100 × 0.01
    assert stats.tpot_p50_ms == pytest.approx(1.0 + 0.1) == stats.tpot_p90_ms
    # 10 tokens every 2.0 + 9 × 1.1 ms
    assert stats.tokens_per_s == pytest.approx(10 / (2.0 + 9 * 1.1) * 1e3)
    assert stats.requests == serving.MEASURED_REQUESTS


def test_a_prompt_longer_than_the_step_budget_takes_several_steps() -> None:
    stats = simulate(_times(), concurrency=1, isl=250, osl=2, chunk=100)
    # three steps of 100, 100 and 50 prompt tokens
    assert stats.ttft_p50_ms == pytest.approx((1.0 + 1.0) * 2 + (1.0 + 0.5))


def test_prompts_arriving_while_others_decode_stretch_their_tpot() -> None:
    alone = 1.0 + 0.1 * 8
    stats = simulate(_times(), concurrency=8, isl=2000, osl=64)
    assert stats.tpot_p50_ms > alone  # some steps carry a 2,000-token prefill (21 ms)
    assert stats.tpot_p90_ms >= stats.tpot_p50_ms
    assert stats.ttft_p50_ms >= 1.0 + 20.0
    assert 0 < stats.mean_running <= 8


@pytest.mark.parametrize("users", [1, 4, 32])
def test_throughput_obeys_littles_law(users: int) -> None:
    isl, osl = 512, 128
    stats = simulate(_times(), concurrency=users, isl=isl, osl=osl)
    # every user always has one request in flight: tokens/s = users × osl / (request time),
    # request time ≈ TTFT + (osl - 1) × TPOT (medians: the loop's requests are alike)
    request_ms = stats.ttft_p50_ms + (osl - 1) * stats.tpot_p50_ms
    assert stats.tokens_per_s == pytest.approx(users * osl / request_ms * 1e3, rel=0.1)


def test_the_simulation_stops_at_its_step_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "MAX_STEPS", 500)
    stats = simulate(_times(), concurrency=2, isl=10, osl=400)
    assert stats.steps <= 500 + 400 and stats.requests >= 1
