"""The supervisor's loop (``kiln supervise``) on components it can start and kill at will (no
processes: the e2e drill does those): a dead component is restarted after a pause that grows
and resets after a stable run, a crash loop is given up and reported, a start that fails counts
as a death, nothing is restarted while ``kiln up`` / ``down`` hold the state directory, and
what is not wanted is left alone."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kiln.embedded.lock import StateDirBusy, state_lock
from kiln.embedded.restarts import RestartPolicy, Restarts
from kiln.embedded.watchdog import Component, Watchdog

POLICY = RestartPolicy(first_delay_s=1.0, max_delay_s=8.0, stable_s=60.0, max_restarts=4)


@dataclass
class Fake:
    """A component that is alive until killed; ``fail`` makes its next starts raise."""

    name: str
    alive: bool = True
    wanted: bool = True
    starts: int = 0
    fail: int = 0

    def start(self) -> None:
        self.starts += 1
        if self.fail:
            self.fail -= 1
            raise RuntimeError(f"{self.name} cannot start\nsecond line")
        self.alive = True

    def component(self) -> Component:
        return Component(
            self.name,
            wanted=lambda: self.wanted,
            alive=lambda: self.alive,
            start=self.start,
            ended=lambda: "killed by SIGKILL",
        )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(fakes: list[Fake], tmp_path: Path, clock: Clock, lines: list[str]) -> Watchdog:
    return Watchdog(
        [f.component() for f in fakes],
        lock=lambda: state_lock(tmp_path, wait_s=0),
        report_path=tmp_path / "report.json",
        log=lines.append,
        policy=POLICY,
        clock=clock,
    )


def _pause_until_restart(dog: Watchdog, fake: Fake, clock: Clock, step: float = 0.05) -> float:
    """Advance the clock look by look until ``fake`` is started again; the pause it took."""
    before, died_at = fake.starts, clock.now
    while fake.starts == before:
        clock.now += step
        dog.look()
        assert clock.now - died_at < 60, "never restarted"
    return clock.now - died_at


def test_a_dead_component_is_restarted_after_a_growing_pause(tmp_path: Path) -> None:
    ledger, clock, lines = Fake("ledger"), Clock(), []
    dog = _watchdog([ledger], tmp_path, clock, lines)
    dog.look()
    pauses = []
    for _ in range(3):
        ledger.alive = False
        pauses.append(_pause_until_restart(dog, ledger, clock))
        clock.now += 1.0  # dies again soon: not a stable run
        dog.look()
    # 1 s, 2 s, 4 s, each jittered down by at most a quarter (and one look's step)
    for pause, nominal in zip(pauses, (1.0, 2.0, 4.0), strict=True):
        assert nominal * 0.75 - 0.06 <= pause <= nominal + 0.06, pauses
    events = [json.loads(line) for line in lines]
    assert [e["event"] for e in events if e["service"] == "ledger"][:3] == [
        "died",
        "restarting",
        "restarted",
    ]
    assert events[0]["how"] == "killed by SIGKILL"
    report = json.loads((tmp_path / "report.json").read_text())["components"]["ledger"]
    assert report["restarts"] == 3 and not report["crash_loop"]
    assert report["note"] == "restarted 3x (last: killed by SIGKILL)"


def test_a_stable_run_resets_the_pause(tmp_path: Path) -> None:
    nats, clock = Fake("nats"), Clock()
    dog = _watchdog([nats], tmp_path, clock, [])
    dog.look()
    for _ in range(3):
        nats.alive = False
        _pause_until_restart(dog, nats, clock)
        dog.look()
    clock.now += POLICY.stable_s + 1  # ran a full stable period
    dog.look()
    nats.alive = False
    assert _pause_until_restart(dog, nats, clock) <= POLICY.first_delay_s + 0.06


def test_a_crash_loop_is_given_up_reported_and_forgotten_on_up(tmp_path: Path) -> None:
    pool, clock, lines = Fake("engine-pool"), Clock(), []
    dog = _watchdog([pool], tmp_path, clock, lines)
    dog.look()
    for _ in range(POLICY.max_restarts):
        pool.alive = False
        _pause_until_restart(dog, pool, clock)
    pool.alive = False
    starts = pool.starts
    for _ in range(300):  # far past the longest pause: it is not started again
        clock.now += 0.2
        dog.look()
    assert pool.starts == starts
    report = json.loads((tmp_path / "report.json").read_text())["components"]["engine-pool"]
    assert report["crash_loop"]
    assert report["note"].startswith(f"crash loop: gave up after {POLICY.max_restarts} restarts")
    assert "`kiln up` tries again" in report["note"]
    loops = [json.loads(line) for line in lines if '"crash loop"' in line]
    assert len(loops) == 1 and loops[0]["level"] == "error"

    dog.reset_requested = True  # what SIGHUP from `kiln up` does
    dog.look()
    _pause_until_restart(dog, pool, clock)
    assert pool.alive and pool.starts == starts + 1


def test_a_start_that_fails_counts_as_a_death(tmp_path: Path) -> None:
    postgres, clock, lines = Fake("postgres", alive=False, fail=2), Clock(), []
    dog = _watchdog([postgres], tmp_path, clock, lines)
    for _ in range(3):
        _pause_until_restart(dog, postgres, clock)
    assert postgres.alive and postgres.starts == 3
    failed = [json.loads(line) for line in lines if '"restart failed"' in line]
    assert len(failed) == 2 and failed[0]["error"] == "postgres cannot start"
    restarts = dog.restarts["postgres"]
    assert restarts.in_a_row == 3 and restarts.last_exit == "restart failed: postgres cannot start"


def test_nothing_is_restarted_while_up_or_down_holds_the_state_dir(tmp_path: Path) -> None:
    ledger, clock = Fake("ledger", alive=False), Clock()
    dog = _watchdog([ledger], tmp_path, clock, [])
    with state_lock(tmp_path):
        for _ in range(200):
            clock.now += 0.1
            dog.look()
        assert ledger.starts == 0
    clock.now += 0.1
    dog.look()
    assert ledger.starts == 1 and ledger.alive


def test_what_is_not_wanted_is_left_alone(tmp_path: Path) -> None:
    """`kiln down` removed its pid file (or `kiln up --no-services` never wrote one)."""
    svc, clock = Fake("cost-model", alive=False, wanted=False), Clock()
    dog = _watchdog([svc], tmp_path, clock, [])
    for _ in range(100):
        clock.now += 0.5
        dog.look()
    assert svc.starts == 0
    assert json.loads((tmp_path / "report.json").read_text())["components"]["cost-model"] == {
        "restarts": 0,
        "crash_loop": False,
        "note": "",
    }


def test_components_are_restarted_in_order(tmp_path: Path) -> None:
    """The servers come back before the services that need them, in the same look."""
    order: list[str] = []
    fakes = [Fake(n, alive=False) for n in ("postgres", "nats", "ledger")]
    for fake in fakes:
        fake.start = lambda f=fake: (order.append(f.name), setattr(f, "alive", True))  # type: ignore[method-assign]
    clock = Clock()
    dog = _watchdog(fakes, tmp_path, clock, [])
    dog.look()
    clock.now += POLICY.first_delay_s + 0.01
    dog.look()
    assert order == ["postgres", "nats", "ledger"]


def test_restarts_describe_what_is_pending() -> None:
    r = Restarts(POLICY)
    assert r.describe(0.0) == ""
    assert r.died(10.0, "exited with status 1")
    assert not r.died(10.5, "exited with status 1")  # the same death, seen again
    assert r.describe(10.0).startswith("died (exited with status 1); restarting in ")


@contextlib.contextmanager
def _busy() -> Iterator[None]:
    raise StateDirBusy("held")
    yield  # pragma: no cover


def test_a_busy_lock_is_tried_again_at_the_next_look(tmp_path: Path) -> None:
    ledger, clock = Fake("ledger", alive=False), Clock()
    dog = _watchdog([ledger], tmp_path, clock, [])
    dog.lock = _busy
    dog.look()  # sees it dead
    clock.now += 5
    dog.look()
    dog.look()
    assert ledger.starts == 0 and dog.restarts["ledger"].due(clock.now)


@pytest.mark.parametrize("failures", [1, 5, 70])
def test_backoff_stays_in_its_band(failures: int) -> None:
    from kiln.common.backoff import backoff_s

    for _ in range(50):
        pause = backoff_s(failures, first_s=0.5, max_s=10.0, jitter=0.5)
        nominal = min(10.0, 0.5 * 2 ** (failures - 1))
        assert nominal * 0.5 <= pause <= nominal
