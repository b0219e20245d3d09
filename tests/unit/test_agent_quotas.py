"""Per-team quotas of the agent runner: the policy (kiln.agent_runner.quotas), the teams' device
time over a window (kiln.agent_runner.team_usage) and admission (kiln.agent_runner.admission):
running slots, the pending queue in submission order, device time, work-item slots."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError

from kiln.agent_runner.admission import Admission
from kiln.agent_runner.quotas import QuotaSettings, TeamOverride
from kiln.agent_runner.team_usage import TeamUsage
from kiln.common.errors import ResourceExhausted
from kiln.v1 import ledger_pb2


# ---------------------------------------------------------------------- the policy
def test_limits_are_the_defaults_with_a_teams_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_QUOTA_MAX_RUNNING", "3")
    monkeypatch.setenv("KILN_QUOTA_DEVICE_SECONDS", "3600")
    monkeypatch.setenv("KILN_QUOTA_TEAMS", json.dumps({"vision": {"max_running": 8}}))
    q = QuotaSettings()
    assert q.limits("search").max_running == 3
    vision = q.limits("vision")
    assert vision.max_running == 8 and vision.device_seconds == 3600  # the rest: the defaults


@pytest.mark.parametrize(
    ("env", "value", "match"),
    [
        ("KILN_QUOTA_MAX_RUNNING", "-1", "greater than or equal to 0"),
        ("KILN_QUOTA_DEVICE_SECONDS", "nan", "finite number"),
        ("KILN_QUOTA_PERIOD_S", "0", "greater than 0"),
        ("KILN_QUOTA_PERIOD_S", "1e12", "less than or equal"),
        ("KILN_QUOTA_TEAMS", '{"Bad Team": {}}', "team names must match"),
        ("KILN_QUOTA_TEAMS", '{"ok": {"max_runing": 2}}', "Extra inputs are not permitted"),
        ("KILN_QUOTA_TEAMS", '{"ok": {"max_in_flight": -2}}', "greater than or equal to 0"),
    ],
)
def test_bad_quota_settings_are_refused(
    monkeypatch: pytest.MonkeyPatch, env: str, value: str, match: str
) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(ValidationError, match=match):
        QuotaSettings()


# ---------------------------------------------------------------------- device time
def _completed(team: str, at_s: float, device_ms: float, kind: str = "ExperimentCompleted") -> Any:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(at_s * 1e9))
    return ledger_pb2.RecordedEvent(
        position=1,
        type=kind,
        data=json.dumps({"status": "ok", "device_ms": device_ms}).encode(),
        metadata=ledger_pb2.EventMetadata(team=team),
        recorded_at=stamp,
    )


def test_device_time_is_counted_per_team_over_the_window() -> None:
    usage, now = TeamUsage(period_s=100.0), time.time()
    usage.take(_completed("a", now - 150, 9000))  # before the window: not counted
    usage.take(_completed("a", now - 90, 2000))
    usage.take(_completed("a", now - 10, 3000))
    usage.take(_completed("b", now - 5, 1000))
    usage.take(_completed("a", now - 5, 7000, kind="ExperimentRequested"))  # not a completion
    assert usage.spent("a", now) == pytest.approx(5.0)
    assert usage.spent("b", now) == pytest.approx(1.0)
    # Below 4 s once the entry at now-90 leaves the window, 10 s from now.
    assert usage.frees_in("a", 4.0, now) == pytest.approx(10.0)
    assert usage.frees_in("a", 6.0, now) == 0.0
    assert usage.spent("a", now + 11) == pytest.approx(3.0)


def test_engine_time_falls_back_to_the_phases() -> None:
    usage, now = TeamUsage(period_s=100.0), time.time()
    event = _completed("a", now, 0.0)
    event.data = json.dumps({"status": "ok", "phases_ms": {"load": 500, "time": 250}}).encode()
    usage.take(event)
    assert usage.spent("a", now) == pytest.approx(0.75)


# ---------------------------------------------------------------------- admission
async def _admitted(adm: Admission, team: str, cid: str, position: int) -> asyncio.Task[None]:
    task = asyncio.create_task(adm.admit(team, cid, position))
    await asyncio.sleep(0)
    return task


async def test_a_team_runs_its_limit_and_the_rest_wait_in_submission_order() -> None:
    adm = Admission(QuotaSettings(max_running=2))
    a = await _admitted(adm, "t", "a", 10)
    b = await _admitted(adm, "t", "b", 11)
    late = await _admitted(adm, "t", "late", 13)
    early = await _admitted(adm, "t", "early", 12)  # queued after, submitted before
    other = await _admitted(adm, "u", "other", 14)  # another team is not held up
    await asyncio.sleep(0)
    assert a.done() and b.done() and other.done()
    assert not early.done() and not late.done()
    assert (adm.running("t"), adm.pending("t")) == (2, 2)
    assert "runs 2 compilations" in adm.why_pending("t")
    adm.release("t", "a")
    await asyncio.wait_for(early, 1)
    assert not late.done()
    adm.release("t", "late")  # cancelled while pending: out of the queue
    assert adm.pending("t") == 0
    late.cancel()


async def test_a_resumed_compilation_keeps_its_slot_beyond_the_limit() -> None:
    adm = Admission(QuotaSettings(max_running=1))
    adm.hold("t", "x")
    adm.hold("t", "y")
    assert adm.running("t") == 2
    waiting = await _admitted(adm, "t", "z", 5)
    adm.release("t", "x")
    await asyncio.sleep(0)
    assert not waiting.done()  # still 1 running, the limit
    adm.release("t", "y")
    await asyncio.wait_for(waiting, 1)


async def test_a_submit_beyond_the_pending_limit_is_resource_exhausted() -> None:
    adm = Admission(QuotaSettings(max_running=1, teams={"t": TeamOverride(max_pending=1)}))
    adm.enqueue("t", "a", 1)  # runs
    adm.check_submit("t")
    adm.enqueue("t", "b", 2)  # waits
    with pytest.raises(ResourceExhausted, match=r"1 compilations waiting.*KILN_QUOTA_MAX_PENDING"):
        adm.check_submit("t")
    adm.check_submit("u")  # per team


async def test_a_team_without_device_time_waits_until_old_usage_leaves_the_window() -> None:
    usage = TeamUsage(period_s=0.3)
    usage.loaded.set()
    usage.add("t", time.time(), 2.0)
    adm = Admission(QuotaSettings(device_seconds=1.0, period_s=0.3), usage)
    assert "spent its device time (2.0 of 1 device-s" in str(adm.device_time_spent("t"))
    waiting = await _admitted(adm, "t", "a", 1)
    assert not waiting.done()
    await asyncio.wait_for(waiting, 5)  # the entry ages out of the 0.3 s window
    assert adm.device_time_spent("t") is None


async def test_device_time_is_not_judged_before_the_usage_is_read() -> None:
    usage = TeamUsage(period_s=100.0)
    adm = Admission(QuotaSettings(device_seconds=1.0), usage)
    waiting = await _admitted(adm, "t", "a", 1)
    await asyncio.sleep(0.1)
    assert not waiting.done()
    usage.loaded.set()
    await asyncio.wait_for(waiting, 5)


async def test_a_teams_work_slots_are_shared_in_turn_by_its_compilations() -> None:
    adm = Admission(QuotaSettings(max_in_flight_team=1))
    order: list[str] = []

    async def work(name: str) -> None:
        async with adm.work_slot("t"):
            order.append(name)
            await asyncio.sleep(0.01)

    await asyncio.gather(work("a1"), work("b1"), work("a2"), work("b2"))
    assert order == ["a1", "b1", "a2", "b2"]
    free = Admission(QuotaSettings(max_in_flight_team=0))
    async with free.work_slot("t"), free.work_slot("t"):
        pass  # no limit
