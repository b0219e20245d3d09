"""The engine pool's scheduling rule: which work subject a free device serves next
(kiln.engine_pool.schedule), alone and as WorkConsumer.order applies it to a pool's lanes."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from kiln.common.settings import KilnSettings
from kiln.engine_pool.devices import Device
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.queue import Lane, WorkConsumer
from kiln.engine_pool.schedule import LaneView, WaitBounds, lane_order
from kiln.engine_pool.settings import EngineSettings

BOUNDS = WaitBounds(full_s=60.0, fast_s=300.0)


def _order(lanes: list[LaneView], room: bool = False) -> list[int]:
    return lane_order(lanes, room=room, bounds=BOUNDS)


def test_a_confirmation_goes_before_search_when_it_evicts_nothing() -> None:
    fast = LaneView("fast", waited_s=50.0, here=True)
    full_here = LaneView("full", waited_s=0.0, here=True)
    assert _order([fast, full_here]) == [1, 0]
    # Not built yet, but the device has room for its engine: still first.
    full_new = LaneView("full", waited_s=0.0, here=False)
    assert _order([fast, full_new], room=True) == [1, 0]


def test_a_confirmation_that_would_evict_a_warm_engine_waits_until_its_bound() -> None:
    fast = LaneView("fast", waited_s=0.0, here=True)
    young = LaneView("full", waited_s=BOUNDS.full_s - 1, here=False)
    assert _order([fast, young]) == [0, 1]
    overdue = LaneView("full", waited_s=BOUNDS.full_s, here=False)
    assert _order([fast, overdue]) == [1, 0]


def test_lanes_of_equal_standing_take_turns_longest_wait_first() -> None:
    a = LaneView("fast", waited_s=0.0, here=True)  # just served
    b = LaneView("fast", waited_s=4.0, here=True)
    c = LaneView("fast", waited_s=2.0, here=True)
    assert _order([a, b, c]) == [1, 2, 0]


def test_an_overdue_search_lane_goes_before_a_fresh_confirmation() -> None:
    starved = LaneView("fast", waited_s=BOUNDS.fast_s + 1, here=False)
    full = LaneView("full", waited_s=1.0, here=True)
    assert _order([full, starved]) == [1, 0]
    # Several overdue: longest wait first, whatever the tier.
    old_full = LaneView("full", waited_s=BOUNDS.full_s + 500, here=False)
    assert _order([full, starved, old_full]) == [2, 1, 0]


def test_own_engines_before_builds_and_builds_of_models_no_other_device_holds() -> None:
    here = LaneView("fast", waited_s=0.0, here=True)
    new = LaneView("fast", waited_s=9.0, here=False)
    held_elsewhere = LaneView("fast", waited_s=20.0, here=False, elsewhere=True)
    assert _order([held_elsewhere, new, here], room=True) == [2, 1, 0]


def test_lanes_that_would_evict_come_last_full_tier_first() -> None:
    evict_fast = LaneView("fast", waited_s=100.0, here=False)
    evict_full = LaneView("full", waited_s=10.0, here=False)
    here = LaneView("fast", waited_s=0.0, here=True)
    assert _order([evict_fast, evict_full, here]) == [2, 1, 0]


def test_wait_bounds_come_from_the_settings_and_are_validated() -> None:
    s = EngineSettings(full_max_wait_s=5, fast_max_wait_s=50)
    assert (s.full_max_wait_s, s.fast_max_wait_s) == (5, 50)
    with pytest.raises(ValueError, match="greater than 0"):
        EngineSettings(full_max_wait_s=0)
    with pytest.raises(ValueError, match="less than or equal"):
        EngineSettings(fast_max_wait_s=1e9)


# ---------------------------------------------------------------------- WorkConsumer.order
@dataclass(frozen=True)
class _Spec:
    tier: str


@dataclass
class _Engine:
    """What the pool's scheduling reads of a held engine (no process is started here)."""

    spec: _Spec
    model_key: str
    closed: bool = False


def _consumer(devices: int = 1, max_engines: int = 2) -> WorkConsumer:
    settings = EngineSettings(consume=False, max_engines=max_engines, full_max_wait_s=60.0)
    pool = EnginePool(
        settings, pool_id="t", devices=[Device(f"cpu:{i}", "cpu") for i in range(devices)]
    )
    return WorkConsumer(KilnSettings(), pool.settings, pool)


def _lane(consumer: WorkConsumer, tier: str, model: str, waited_s: float = 0.0) -> Lane:
    subject = f"kiln.work.experiments.cpu.{tier}.{model}"
    lane = Lane(subject, "cpu", tier, model, sub=None, queued=1)
    lane.since = time.monotonic() - waited_s
    consumer.lanes[subject] = lane
    return lane


def _hold(consumer: WorkConsumer, device: str, tier: str, model: str) -> None:
    engine: Any = _Engine(_Spec(tier), model)
    consumer.pool.slots[device].engines[f"{tier}/{model}"] = engine


def test_order_puts_a_waiting_confirmation_first_once_overdue_even_if_it_evicts() -> None:
    c = _consumer(max_engines=2)
    _hold(c, "cpu:0", "fast", "m1")
    _hold(c, "cpu:0", "fast", "m2")  # the device is full: a full-tier engine evicts one
    fast1, fast2 = _lane(c, "fast", "m1", 1.0), _lane(c, "fast", "m2", 3.0)
    full = _lane(c, "full", "m1", 10.0)
    slot = c.pool.slots["cpu:0"]
    assert c.order(slot) == [fast2, fast1, full]
    full.since -= 60.0  # now past KILN_ENGINE_FULL_MAX_WAIT_S
    assert c.order(slot) == [full, fast2, fast1]


def test_order_serves_a_confirmation_first_while_the_device_has_room() -> None:
    c = _consumer(max_engines=2)
    _hold(c, "cpu:0", "fast", "m1")
    fast, full = _lane(c, "fast", "m1", 5.0), _lane(c, "full", "m1", 0.0)
    assert c.order(c.pool.slots["cpu:0"]) == [full, fast]


def test_order_leaves_a_model_another_device_holds_to_that_device() -> None:
    c = _consumer(devices=2, max_engines=2)
    _hold(c, "cpu:1", "fast", "m2")
    mine, theirs = _lane(c, "fast", "m1", 0.0), _lane(c, "fast", "m2", 5.0)
    assert c.order(c.pool.slots["cpu:0"]) == [mine, theirs]
    assert c.order(c.pool.slots["cpu:1"]) == [theirs, mine]


def test_a_lane_starts_waiting_when_work_appears_on_it() -> None:
    c = _consumer()
    lane = _lane(c, "fast", "m1", 100.0)
    lane.count(0)
    before = time.monotonic()
    lane.count(2)
    assert lane.since >= before  # empty, then work: its wait starts now
    since = lane.since
    lane.count(3)
    assert lane.since == since  # more work on a waiting lane: the wait goes on
