"""The serving model (kiln.cost_model.serving) on step times whose answers can be worked out by
hand: a lone user, chunked prefill, prefill interference, Little's law."""

from __future__ import annotations

import pytest

from kiln.cost_model import serving
from kiln.cost_model.serving import StepTimes, simulate


def _times(
    fixed: float = 1.0, per_seq: float = 0.1, per_prompt_token: float = 0.01, math: float = 0.0
) -> StepTimes:
    """fixed 1 ms a step + the larger of memory (0.5 ms of weights + 0.1 ms a running
    sequence) and math (``math`` ms a running sequence + 0.01 ms a prompt token)."""
    return StepTimes(
        fixed, lambda n: 0.5 + per_seq * n, lambda n: math * n, lambda t: per_prompt_token * t
    )


def test_a_lone_user_waits_one_prefill_then_one_step_a_token() -> None:
    stats = simulate(_times(), concurrency=1, isl=100, osl=10)
    assert stats.ttft_p50_ms == pytest.approx(1.0 + 1.0)  # fixed + 100 × 0.01 (> 0.6 memory)
    assert stats.tpot_p50_ms == pytest.approx(1.0 + 0.6) == stats.tpot_p90_ms
    # 10 tokens every 2.0 + 9 × 1.6 ms
    assert stats.tokens_per_s == pytest.approx(10 / (2.0 + 9 * 1.6) * 1e3)
    assert stats.requests == serving.MEASURED_REQUESTS


def test_a_prompt_longer_than_the_step_budget_takes_several_steps() -> None:
    stats = simulate(_times(), concurrency=1, isl=250, osl=2, chunk=100)
    # three steps of 100, 100 and 50 prompt tokens: 1 + max(0.6, 1.0), again, 1 + max(0.6, 0.5)
    assert stats.ttft_p50_ms == pytest.approx(2.0 + 2.0 + 1.6)


def test_a_later_chunk_pays_attention_over_the_tokens_before_it() -> None:
    quadratic = StepTimes(1.0, lambda n: 0.5, lambda n: 0.0, lambda t: 1e-4 * t * t)
    stats = simulate(quadratic, concurrency=1, isl=200, osl=2, chunk=100)
    # [0, 100): 1e-4 × 100² = 1 ms; [100, 200): 1e-4 × (200² − 100²) = 3 ms
    assert stats.ttft_p50_ms == pytest.approx((1.0 + 1.0) + (1.0 + 3.0))


def test_decode_math_and_prompt_math_do_not_overlap() -> None:
    # decode compute-bound (1 ms of math a sequence against 0.6 of memory): a step with a
    # 100-token prompt costs 1 + (2 × 1.0 + 1.0), not 1 + max(2.0, 1.0)
    busy = StepTimes(1.0, lambda n: 0.6, lambda n: 1.0 * n, lambda t: 0.01 * t)
    assert busy.step_ms(2, 1.0) == pytest.approx(4.0)
    assert busy.step_ms(0, 0.2) == pytest.approx(1.6)  # a forward reads the weights at least


def test_the_step_budget_holds_every_running_sequence() -> None:
    stats = simulate(_times(), concurrency=300, isl=10, osl=20, chunk=100)
    assert stats.mean_running > 100  # more sequences decode together than a 100-token budget


def test_prompts_arriving_while_others_decode_stretch_their_tpot() -> None:
    alone = 1.0 + 0.5 + 0.1 * 8
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
    stats = simulate(_times(), concurrency=2, isl=10, osl=4_000_000)
    # no request finished: TTFT of those started, TPOT so far (both users decoding)
    assert stats.steps == 500 and stats.requests == 2
    assert stats.ttft_p50_ms == pytest.approx(1.0 + 0.6)  # both prompts in the first step
    assert stats.tpot_p50_ms == pytest.approx(1.0 + 0.7)  # two decoding: 0.5 + 2 × 0.1
