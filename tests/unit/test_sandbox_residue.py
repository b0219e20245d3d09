"""What one sandboxed candidate leaves behind never reaches the next one (docs/design/engine.md,
"Sandbox", "Lifecycle"), whatever its outcome: a code module that replaces
``torch.nn.functional.linear`` with a wrong one and then raises while loading, or is refused at
bind, is put back and checked like one that loads, and its sandbox is replaced. The next,
honest candidate checks at load that ``F.linear`` is torch's own and uses it in its MLP. The
engine here is the real one (in this process, the judge) with its real sandbox process.

Processes it starts are residue too: a detached grandchild (double fork, ``setsid``) is gone
once its sandbox is replaced, and when the judge is killed with SIGKILL; a fork bomb stops at
the sandbox's process limit, and the engine measures the next candidate. Its ``/dev/shm`` is its
own (what it writes there is neither on the host's nor in the next sandbox's), and it creates
nothing else beneath ``/dev``. Where the sandbox has
no user namespace of its own (the host refuses one) those tests are skipped.
"""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.domain.candidate import Candidate
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.sandbox.confine import NPROC_BASE, NPROC_PER_CPU
from kiln.runtime.sandbox.processes import descendants
from kiln.runtime.spec import EngineLimits, EngineSpec

from .engine_testing import module, tiny_workload

LIMITS = EngineLimits(max_batch=3, max_context=40, prompt_len=8, check_steps=1, check_batch=2)

# the red team's sabotage: a slow, slightly wrong F.linear for whoever comes next
PATCH = """
import torch.nn.functional as F

_real = F.linear

def _slow_linear(x, w, b=None):
    time.sleep(0.002)
    return _real(x, w, b) * 1.001

F.linear = _slow_linear
"""
RAISES_AT_LOAD = module("saboteur_raises", PATCH + "raise RuntimeError('oops, failed to load')\n")
REFUSED_AT_BIND = module("saboteur_refused", PATCH)

# the next team's honest candidate: its MLP goes through F.linear, which it checks first
HONEST = module(
    "honest_linear_mlp",
    """
import torch.nn.functional as F

if F.linear is not torch._C._nn.linear:
    raise RuntimeError(f"residue: F.linear is {F.linear!r}")

@register("mlp", "linear_mlp", replace=True)
def linear_mlp(x, *, gate_weight, up_weight, down_weight):
    gate = F.linear(x, gate_weight)
    return F.linear((gate * torch.sigmoid(gate)) * F.linear(x, up_weight), down_weight)
""",
)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    spec = EngineSpec.from_workload(tiny_workload(), "fast", LIMITS)
    e = Engine(spec, engine_id="sandbox-residue")
    try:
        yield e
    finally:
        e.close()


def _run(engine: Engine, candidate: Candidate) -> Measurement:
    m = engine.run(RunRequest("residue", candidate, warmup=1, repeats=2, seed=3))
    engine.after_reply()  # what the worker does once the result is sent
    return m


@pytest.mark.parametrize(
    ("saboteur", "status"),
    [
        (Candidate.make(code_modules=[RAISES_AT_LOAD]), "crashed"),
        (Candidate.make({"mlp": "no_such_mlp"}, code_modules=[REFUSED_AT_BIND]), "rejected"),
    ],
    ids=["raises_at_load", "refused_at_bind"],
)
def test_a_failed_candidates_residue_never_reaches_the_next_one(
    engine: Engine, saboteur: Candidate, status: str
) -> None:
    honest = Candidate.make({"mlp": "linear_mlp"}, code_modules=[HONEST])
    assert _run(engine, honest).status == "ok"  # a sandbox that has run a candidate
    host = engine._sandbox
    assert host is not None
    pid, replaced = host.pid, len(host.replaced)
    m = _run(engine, saboteur)
    assert m.status == status, m.error
    # put back and checked: the patched F.linear is seen and the sandbox replaced
    assert len(host.replaced) == replaced + 1
    assert "torch.nn.functional" in host.replaced[-1] and "linear" in host.replaced[-1]
    assert host.pid not in (0, pid)
    m = _run(engine, honest)
    assert m.status == "ok", m.error  # its load would raise on the residue


# double fork and setsid: the grandchild, in a session of its own, writes its host pid and waits
DETACHED = module(
    "detached_grandchild",
    """
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.setsid()
    if os.fork():
        os._exit(0)
    os.write(w, os.readlink("/proc/self").encode())
    time.sleep(600)
    os._exit(0)
os.waitpid(child, 0)
with open(os.path.join(os.environ["HOME"], "grandchild.pid"), "wb") as f:
    f.write(os.read(r, 32))
""",
)

# forks until the kernel refuses; the children wait; it reports how many and why it stopped
FORK_BOMB = module(
    "fork_bomb",
    """
import signal

forks, stopped = 0, "never"
while forks < 100000:
    try:
        pid = os.fork()
    except OSError as exc:
        stopped = type(exc).__name__
        break
    if pid == 0:
        signal.pause()
        os._exit(0)
    forks += 1
with open(os.path.join(os.environ["HOME"], "forks.txt"), "w") as f:
    f.write(f"{forks} {stopped}")
""",
)


# tries /dev/shm and a new file beneath /dev; says what it saw
SHM = module(
    "shm_writer",
    """
report = {"seen": sorted(os.listdir("/dev/shm"))}
for path in ("/dev/shm/kiln-residue", "/dev/kiln-residue"):
    try:
        open(path, "w").close()
        report[path] = "written"
    except OSError as exc:
        report[path] = type(exc).__name__
with open("/dev/null", "w") as f:
    f.write("devices still writable")
with open(os.path.join(os.environ["HOME"], "shm.txt"), "w") as f:
    f.write(repr(report))
""",
)


def test_dev_shm_is_an_empty_one_of_its_own_and_dev_takes_no_file(engine: Engine) -> None:
    marker = Path("/dev/shm", f"kiln-host-{os.getpid()}")
    marker.write_text("the host's")
    try:
        m = _run_kept(engine, Candidate.make(code_modules=[SHM]))
        assert m.status == "ok", m.error
        _own_namespaces(engine)
        host = engine._sandbox
        assert host is not None
        report = ast.literal_eval(Path(host.home, "shm.txt").read_text())
        assert report["seen"] == [], report  # not the host's /dev/shm
        assert report["/dev/shm/kiln-residue"] != "written", report
        assert report["/dev/kiln-residue"] == "PermissionError", report  # Landlock: EACCES
        assert not Path("/dev/shm/kiln-residue").exists() and not Path("/dev/kiln-residue").exists()
    finally:
        marker.unlink()
        engine.after_reply()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _own_namespaces(engine: Engine) -> None:
    host = engine._sandbox
    assert host is not None
    if any("no user namespace" in n or "no pid namespace" in n for n in host.confinement):
        pytest.skip(f"the host refused the sandbox its namespaces: {host.confinement}")


def test_a_detached_grandchild_is_gone_when_its_sandbox_is_replaced(engine: Engine) -> None:
    m = _run_kept(engine, Candidate.make(code_modules=[DETACHED]))
    assert m.status == "ok", m.error
    _own_namespaces(engine)
    host = engine._sandbox
    assert host is not None
    pid = int(Path(host.home, "grandchild.pid").read_text())
    assert _alive(pid) and pid in descendants(host._proc.popen.pid)  # type: ignore[union-attr]
    before = host.pid
    engine.after_reply()
    assert "left 1 process(es) running" in host.replaced[-1]
    assert not _alive(pid) and host.pid not in (0, before)
    assert _run(engine, Candidate.make({"mlp": "linear_mlp"}, code_modules=[HONEST])).status == "ok"


def test_a_fork_bomb_stops_at_the_limit_and_the_engine_goes_on(engine: Engine) -> None:
    m = _run_kept(engine, Candidate.make(code_modules=[FORK_BOMB]))
    assert m.status == "ok", m.error
    _own_namespaces(engine)
    host = engine._sandbox
    assert host is not None
    forks, stopped = Path(host.home, "forks.txt").read_text().split()
    assert stopped == "BlockingIOError"  # EAGAIN: RLIMIT_NPROC
    assert 0 < int(forks) < NPROC_BASE + NPROC_PER_CPU * (os.cpu_count() or 1)
    children = descendants(host._proc.popen.pid)  # type: ignore[union-attr]
    assert len(children) >= int(forks)
    engine.after_reply()
    assert f"left {int(forks)} process(es) running" in host.replaced[-1]
    assert not any(_alive(p) for p in children)
    assert _run(engine, Candidate.make({"mlp": "linear_mlp"}, code_modules=[HONEST])).status == "ok"


JUDGE = """
import sys
sys.path[:0] = {paths!r}
from kiln.domain.candidate import Candidate
from kiln.runtime.engine import Engine
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from tests.unit.engine_testing import tiny_workload
from tests.unit.test_sandbox_residue import DETACHED, LIMITS

engine = Engine(EngineSpec.from_workload(tiny_workload(), "fast", LIMITS), engine_id="judge")
m = engine.run(RunRequest("judge", Candidate.make(code_modules=[DETACHED]), warmup=1, repeats=2))
print(m.status, engine._sandbox.home, "; ".join(engine._sandbox.confinement), flush=True)
sys.stdin.read()  # until killed
"""


def test_a_detached_grandchild_dies_with_a_killed_judge() -> None:
    paths = [str(Path(__file__).parents[2]), *sys.path]
    judge = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(JUDGE.format(paths=paths))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert judge.stdout is not None
        status, home, confinement = [*judge.stdout.readline().rstrip("\n").split(" ", 2), ""][:3]
        assert status == "ok"
        if "no user namespace" in confinement or "no pid namespace" in confinement:
            pytest.skip(f"the host refused the sandbox its namespaces: {confinement}")
        pid = int(Path(home, "grandchild.pid").read_text())
        assert _alive(pid)
        judge.send_signal(signal.SIGKILL)
        judge.wait(30)
        for _ in range(300):  # the kernel's kills, not a speed: wait up to 30 s
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid)
    finally:
        judge.kill()
        judge.wait(30)


def _run_kept(engine: Engine, candidate: Candidate) -> Measurement:
    """Like :func:`_run`, but before the sandbox is put back (the test looks at it first)."""
    return engine.run(RunRequest("residue", candidate, warmup=1, repeats=2, seed=3))
