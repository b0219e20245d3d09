"""The red team on CPU engines: every cheating candidate of :mod:`tests.red_team.cheats` that
the engine rejects today is INCORRECT with its reason, and every one that escapes today comes
back ``ok`` having played its trick (an xfail naming the defense it needs); honest candidates
built the same way pass; the output cheats do get past the checks a naive engine makes (so they
are real cheats), and the engine is clean after each (the next reference run is ok).

Plus the gate's parts on their own: the timed-output reservoir, the timers, the thread watch and
the harness fingerprint.
"""

from __future__ import annotations

import collections
import functools
import json
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kiln.domain.candidate import Candidate
from kiln.runtime.check import TimedOutputs
from kiln.runtime.device_fault import SANDBOX_FAULT
from kiln.runtime.dispatch_watch import DispatchTables
from kiln.runtime.engine import Engine
from kiln.runtime.engine_sandbox import WRITTEN_IN_SANDBOX
from kiln.runtime.integrity import HarnessFingerprint
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from kiln.runtime.thread_watch import ThreadWatch
from kiln.runtime.timing import CpuTimer
from kiln.workloads.models.decoder import DecoderModel
from tests.red_team import cheats as red_team

from .engine_testing import TINY_LLAMA, tiny_workload
from .red_team_testing import Escaped, cheat_param, played, putting_back, spy_on_loads

LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)
# A larger vocabulary than the other engine tests': the LM head then takes long enough that
# work deferred to a thread is still running when the timed call returns.
VOCAB = 4096
PERF_COUNTER = time.perf_counter


@pytest.fixture(autouse=True)
def _dispatcher_left_as_found() -> Iterator[None]:
    """No cheat's kernel outlives its test (else every later reference computes with it)."""
    tables = DispatchTables.take()
    yield
    assert tables.changes() == []


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    workload = tiny_workload(batch=3, context=24)
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "vocab_size": VOCAB})
    yield Engine(EngineSpec.from_workload(workload, "fast", LIMITS), engine_id="red-team")


def _run(engine: Engine, candidate: Candidate, **kw: int) -> Measurement:
    kw = {"repeats": 4, **kw}
    return engine.run(RunRequest("red-team", candidate, warmup=1, **kw))


ENGINE_OF = {"float32": "engine", "bfloat16": "bf16_engine"}
"""The engine fixture of a cheat's dtype."""


@pytest.mark.parametrize("cheat", [cheat_param(c) for c in red_team.cheats("cpu")])
def test_every_cheat_is_rejected(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, cheat: red_team.Cheat
) -> None:
    """Against the sandboxed engine: INCORRECT with :attr:`Cheat.sandboxed` in the error, or,
    for a disarmed cheat, ok without having played its trick."""
    engine: Engine = request.getfixturevalue(ENGINE_OF[cheat.dtype])
    _judge_sandboxed(engine, cheat, monkeypatch, _run)


def _judge_sandboxed(
    engine: Engine,
    cheat: red_team.Cheat,
    monkeypatch: pytest.MonkeyPatch,
    run_on: Callable[..., Measurement],
) -> None:
    """``cheat`` run :attr:`Cheat.runs` times on the sandboxed ``engine`` (through ``run_on``):
    each INCORRECT with its reason, or ok without playing for a disarmed one; the reference is
    measured correctly after it and the weights are intact. On CUDA a device fault in the
    sandbox (a write to the weights it maps read-only) is a rejection too: CRASHED, the
    sandbox replaced, the judge's context intact."""
    loaded = spy_on_loads(monkeypatch)
    with putting_back(engine) as restart:
        for run in range(cheat.runs):
            loaded.clear()
            if engine._sandbox is not None:
                engine._sandbox.last_report = {}
            steps = cheat.timed_steps
            m = run_on(engine, cheat.candidate, repeats=steps, min_repeats=min(steps, 5))
            trick = played(loaded, engine)
            if cheat.disarmed:
                assert m.status == "ok", (m.status, m.error)
                assert trick is not True, f"{cheat.name} played its trick and came back ok"
                continue
            if m.status == "ok" and trick is not False:
                raise Escaped(f"{cheat.name}: ok on run {run + 1} of {cheat.runs}: {m.notes}")
            if m.status == "ok":  # a cheat by chance that happened not to cheat: again
                assert cheat.runs > 1 or cheat.needs, f"{cheat.name}: ok without playing its trick"
                continue
            if m.status == "crashed" and m.error.startswith(SANDBOX_FAULT):
                assert engine.device.type == "cuda", m.error
                continue
            assert m.status == "incorrect" and not m.correct, (m.status, m.error)
            assert m.timing is None and m.tokens_per_s == 0.0
            # A host that counts the pages the sandbox copied from its private mapping of the
            # weights rejects a write there before the judge's verdict: as strong a rejection.
            if not m.error.startswith(WRITTEN_IN_SANDBOX):
                for text in cheat.sandboxed:
                    assert text in m.error, (text, m.error)
            if m.restart_engine:
                restart()  # weights changed in place are what only a restart puts back
        # Whatever else it did is undone (by the engine): it measures the reference correctly
        # next.
        after = run_on(engine, Candidate())
        assert after.status == "ok", after.error
        assert DecoderModel._layer.__name__ == "_layer" and time.perf_counter is PERF_COUNTER
        assert "decode_step" not in engine.model.__dict__
        assert engine.weights_intact()


@pytest.mark.parametrize("cheat", [cheat_param(c) for c in red_team.cheats("cpu", sandboxed=False)])
def test_every_cheat_in_process(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, cheat: red_team.Cheat
) -> None:
    """The in-process watches (an engine built with ``sandbox=False``, what recipes run under):
    each cheat INCORRECT with :attr:`Cheat.caught`, or escaping as its xfail says."""
    engine: Engine = request.getfixturevalue("inprocess_" + ENGINE_OF[cheat.dtype])
    loaded = spy_on_loads(monkeypatch)
    with putting_back(engine) as restart:
        for run in range(cheat.runs):
            loaded.clear()
            steps = cheat.timed_steps
            m = _run(engine, cheat.candidate, repeats=steps, min_repeats=min(steps, 5))
            if m.status == "ok" and played(loaded) is not False:
                raise Escaped(f"{cheat.name}: ok on run {run + 1} of {cheat.runs}: {m.notes}")
            if m.status == "ok":
                assert cheat.runs > 1 or cheat.needs, f"{cheat.name}: ok without playing its trick"
                continue
            assert m.status == "incorrect" and not m.correct, (m.status, m.error)
            for text in cheat.caught:
                assert text in m.error, (text, m.error)
            if m.restart_engine:
                restart()
        after = _run(engine, Candidate())
        assert after.status == "ok", after.error
        assert engine.weights_intact()


@pytest.fixture(scope="module")
def inprocess_engine() -> Iterator[Engine]:
    workload = tiny_workload(batch=3, context=24)
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "vocab_size": VOCAB})
    spec = EngineSpec.from_workload(workload, "fast", LIMITS)
    yield Engine(spec, engine_id="red-team-in-process", sandbox=False)


@pytest.fixture(scope="module")
def inprocess_bf16_engine() -> Iterator[Engine]:
    workload = tiny_workload(batch=3, context=24, dtype="bfloat16")
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "vocab_size": VOCAB})
    spec = EngineSpec.from_workload(workload, "fast", LIMITS)
    yield Engine(spec, engine_id="red-team-in-process-bf16", sandbox=False)


OUTPUT_CHEATS = [
    c
    for c in red_team.cheats("cpu", sandboxed=False)
    if c.caught
    and set(c.caught) <= {red_team.VERIFIED, "non-finite"}
    and c.dtype == "float32"
    and c.kind not in ("i", "k")  # patched watches and chance: test_every_cheat_is_rejected
]


@pytest.mark.parametrize("cheat", OUTPUT_CHEATS, ids=lambda c: c.name)
def test_output_cheats_pass_every_check_but_the_timed_one(
    inprocess_engine: Engine, cheat: red_team.Cheat
) -> None:
    """With no timed step verified, these cheats pass the check at the traffic shape and the
    prefill/decode check: they are real cheats, and verifying timed steps is what stops them."""
    m = _run(inprocess_engine, cheat.candidate, verify_timed_steps=0)
    assert m.status == "ok", m.error
    assert any("verified timed step(s) none" in n for n in m.notes)


@pytest.mark.parametrize(
    "name",
    [
        "shared_class_patch",
        "kernel_override",
        "hidden_kernel_override",
        "gate_patch",
        "fake_clock",
        "id_patch",
    ],
)
def test_tampering_cheats_fool_the_comparison_alone(inprocess_engine: Engine, name: str) -> None:
    """Changing what the reference (or the comparison, or the clock) does makes the outputs
    agree: only the fingerprint sees these. (``reduced_precision`` too, where the reduced
    kernels are deterministic; on this CPU the float32-to-bfloat16 matmuls are not always. The
    cheats that steer the verified step's draw are now caught by the verified steps as well.)"""
    (cheat,) = [c for c in red_team.CHEATS if c.name == name]
    m = _run(inprocess_engine, cheat.candidate)
    assert m.status == "incorrect" and red_team.TAMPERED in m.error
    assert "(gate said" not in m.error  # the gate itself said ok
    assert _run(inprocess_engine, Candidate()).status == "ok"


@pytest.mark.parametrize(
    ("name", "candidate"), red_team.honest("cpu"), ids=[n for n, _ in red_team.honest("cpu")]
)
@pytest.mark.parametrize("dtype", list(ENGINE_OF))
def test_honest_candidates_built_like_the_cheats_pass(
    request: pytest.FixtureRequest, dtype: str, name: str, candidate: Candidate
) -> None:
    m = _run(request.getfixturevalue(ENGINE_OF[dtype]), candidate, verify_timed_steps=4)
    assert m.status == "ok", (name, m.error)
    assert m.correct and not m.restart_engine
    assert any("verified timed step(s) 1, 2, 3, 4 of 4" in n for n in m.notes), m.notes


def test_every_timed_step_can_be_verified_and_costs_one_reference_step(engine: Engine) -> None:
    m = _run(engine, Candidate.make({"attention": "sdpa"}), verify_timed_steps=2)
    assert m.status == "ok", m.error
    assert "verify" in m.phases_ms and m.phases_ms["verify"] > 0
    (note,) = [n for n in m.notes if n.startswith("verified timed step(s)")]
    assert note.endswith("of 4 against the reference (chosen after each call returned)")
    assert len(note.split(" of ")[0].split(",")) == 2


# --------------------------------------------------------------------------- on CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cuda_engine(dtype: str, engine_id: str, *, sandbox: bool = True) -> Engine:
    from kiln.engine_pool.settings import EngineSettings

    workload = tiny_workload(batch=4, context=64, dtype=dtype)
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "vocab_size": VOCAB})
    limits = EngineSettings(device="cuda:0").limits()
    spec = EngineSpec.from_workload(workload, "fast", limits)
    return Engine(spec, engine_id=engine_id, sandbox=sandbox)


@pytest.fixture(scope="module")
def cuda_engine() -> Iterator[Engine]:
    yield _cuda_engine("bfloat16", "red-team-cuda")


@pytest.fixture(scope="module")
def cuda_f32_engine() -> Iterator[Engine]:
    yield _cuda_engine("float32", "red-team-cuda-f32")


CUDA_ENGINE_OF = {"float32": "cuda_f32_engine", "bfloat16": "cuda_engine"}


def _run_cuda(engine: Engine, candidate: Candidate, **kw: int) -> Measurement:
    kw = {"warmup": 2, "repeats": 30, "min_repeats": 10, **kw}
    return engine.run(RunRequest("red-team", candidate, **kw))


@cuda
@pytest.mark.parametrize("cheat", [cheat_param(c) for c in red_team.cheats("cuda")])
def test_every_cheat_is_rejected_on_cuda(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, cheat: red_team.Cheat
) -> None:
    """The CPU test's judgement on sandboxed CUDA engines (weights shared over CUDA IPC)."""
    engine: Engine = request.getfixturevalue(CUDA_ENGINE_OF[cheat.dtype])
    _judge_sandboxed(engine, cheat, monkeypatch, _run_cuda)


@cuda
@pytest.mark.parametrize(
    ("name", "candidate"), red_team.honest("cuda"), ids=[n for n, _ in red_team.honest("cuda")]
)
def test_honest_candidates_pass_on_cuda(
    cuda_engine: Engine, name: str, candidate: Candidate
) -> None:
    m = _run_cuda(cuda_engine, candidate, verify_timed_steps=5)
    assert m.status == "ok", (name, m.error)


@cuda
def test_the_cuda_timer_counts_work_left_on_a_side_stream() -> None:
    """In the judge's process (where recipes run) and unverified, the side-stream cheat passes,
    but its time is counted: every timed step includes the ~1 ms the side stream spends (an
    event timer on the current stream would report the step without it). In the sandbox the
    output's copy to the shared buffer runs before the side stream ends: the check fails it."""
    cuda_engine = _cuda_engine("bfloat16", "red-team-cuda-in-process", sandbox=False)
    (cheat,) = [c for c in red_team.CHEATS if c.name == "side_stream"]
    honest = _run_cuda(cuda_engine, Candidate())
    m = _run_cuda(cuda_engine, cheat.candidate, verify_timed_steps=0)
    assert m.status == "ok" and m.timing is not None and honest.timing is not None, m.error
    assert m.timing.p10_ms > honest.timing.median_ms + 0.5, (m.timing, honest.timing)


# --------------------------------------------------------------------------- the parts


def test_timed_outputs_keep_a_uniform_sample_of_copies() -> None:
    counts: collections.Counter[int] = collections.Counter()
    for _ in range(3000):
        kept = TimedOutputs(1)
        for step in range(6):
            copy = kept.offer(step, torch.full((1, 2), float(step)))
            if copy is not None:
                copy()
        ((step, logits),) = kept.kept()
        assert float(logits[0, 0]) == step
        counts[step] += 1
    assert set(counts) == set(range(6))
    assert all(350 < n < 650 for n in counts.values()), counts  # 500 expected each
    out = torch.ones(2, 3)
    two = TimedOutputs(2)
    copy = two.offer(0, out)
    assert copy is not None
    copy()
    out.fill_(float("nan"))  # the copy was taken: later writes do not reach it
    assert bool((two.kept()[0][1] == 1).all())
    with pytest.raises(TypeError, match="not a tensor"):
        two.offer(1, (out,))
    assert TimedOutputs(0).kept() == []


def test_cpu_timer_clock_is_bound_and_keep_is_untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    timer = CpuTimer()
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)  # a candidate's fake clock
    seen: list[object] = []

    def call() -> str:
        time.sleep(0.01)
        return "out"

    def keep(out: object) -> Callable[[], None]:
        seen.append(out)
        return functools.partial(time.sleep, 0.05)

    ms = timer.time_ms(call, keep)
    assert seen == ["out"]
    assert 9 < ms < 45  # the sleep inside the call, not the one in keep, not the fake clock


def _candidate_function(source: str, name: str) -> types.FunctionType:
    namespace: dict[str, object] = {"time": time, "threading": threading}
    exec(compile(source, "<candidate:test#0>", "exec"), namespace)
    fn = namespace[name]
    assert isinstance(fn, types.FunctionType)
    return fn


def test_thread_watch_names_threads_doing_candidate_work() -> None:
    busy = _candidate_function(
        "def busy(stop):\n    while not stop.is_set():\n        time.sleep(0.001)\n", "busy"
    )
    watch = ThreadWatch()
    assert watch.strays() == []
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()
        assert ThreadWatch().strays() == []  # an idle pool thread does no candidate work
    stop = threading.Event()
    thread = threading.Thread(target=busy, args=(stop,), name="busy")
    thread.start()
    try:
        (line,) = watch.strays()
        assert "'busy' runs candidate code: busy (<candidate:test#0>" in line
        assert ThreadWatch().strays(new_threads=False) == [line]
    finally:
        stop.set()
        thread.join()
    sleeper = threading.Thread(target=time.sleep, args=(0.2,), name="plain")
    sleeper.start()
    try:
        assert watch.strays() == ["thread 'plain' started during the call is still running"]
        assert watch.strays(new_threads=False) == []
    finally:
        sleeper.join()


def test_fingerprint_sees_and_undoes_patches_of_the_reference_and_numerics() -> None:
    fingerprint = HarnessFingerprint.take()
    assert fingerprint.changes() == []
    layer, code = DecoderModel._layer, DecoderModel._layer.__code__
    linear = torch.nn.functional.linear
    DecoderModel._layer.__code__ = (lambda self, *a: None).__code__
    DecoderModel.extra = 1  # type: ignore[attr-defined]
    torch.nn.functional.linear = lambda *a, **k: a[0]
    torch.set_float32_matmul_precision("medium")
    mode = torch.overrides.TorchFunctionMode()
    mode.__enter__()
    try:
        changes = "\n".join(fingerprint.changes())
        assert "DecoderModel._layer modified in place" in changes
        assert "DecoderModel.extra added" in changes
        assert "torch.nn.functional.linear replaced" in changes
        assert "get_float32_matmul_precision() changed from 'highest' to 'medium'" in changes
        assert "torch function modes: 0 -> 1 active" in changes
    finally:
        problems = fingerprint.restore()
    assert problems == [] and fingerprint.changes() == []
    assert DecoderModel._layer is layer and layer.__code__ is code
    assert not hasattr(DecoderModel, "extra") and torch.nn.functional.linear is linear
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch._C._len_torch_function_stack() == 0


def test_dispatch_tables_name_and_undo_a_kernel_hidden_from_torch_library() -> None:
    tables = DispatchTables.take()
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mm", lambda a, b: a.new_zeros(a.shape[0], b.shape[1]), "CPU")
    torch.library._impls.difference_update(lib._op_impls)  # what a finalizer or a cheat does
    ones = torch.ones(2, 2)
    assert (ones @ ones).eq(0).all()
    assert [line.split(" (")[0] for line in tables.changes()] == [
        "dispatcher kernel for aten::mm at CPU replaced"
    ]
    assert tables.restore() == [] and (ones @ ones).eq(2).all()


def test_fingerprint_covers_instances_given() -> None:
    holder = types.SimpleNamespace(a=1, b=functools.partial(max, 1, key=abs))
    fingerprint = HarnessFingerprint.take([("holder", holder, None)])
    holder.b.keywords["key"] = None
    holder.c = 3
    assert set(fingerprint.changes()) == {
        "holder.b modified in place (code, defaults or closure)",
        "holder.c added",
    }
    fingerprint.restore()
    assert holder.b.keywords == {"key": abs} and not hasattr(holder, "c")
    assert sys.gettrace() is None or fingerprint.changes() == []


@pytest.fixture(scope="module")
def bf16_engine() -> Iterator[Engine]:
    workload = tiny_workload(batch=3, context=24, dtype="bfloat16")
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, "vocab_size": VOCAB})
    yield Engine(EngineSpec.from_workload(workload, "fast", LIMITS), engine_id="red-team-bf16")


NUMERIC_CHEATS = [
    c
    for c in red_team.cheats("cpu", sandboxed=False)
    if c.caught
    and not {red_team.TAMPERED, red_team.OUTSIDE} & set(c.caught)
    and c.kind not in ("i", "k", "l")  # i, k: run as test_every_cheat_is_rejected does; l: lossy
    # arithmetic is judged against each dtype's own precision
    and c.name != "reduced_precision"  # deterministic only where the reduced kernels are
]


@pytest.mark.parametrize("cheat", NUMERIC_CHEATS, ids=lambda c: c.name)
def test_cheats_judged_by_the_numbers_are_rejected_against_the_exact_forward_in_bf16(
    bf16_engine: Engine, cheat: red_team.Cheat
) -> None:
    """In bfloat16 the tolerance is a small multiple of the reference's own error against its
    float64 forward: far below what skipping layers, rows or work costs."""
    with putting_back(bf16_engine) as restart:
        m = _run(bf16_engine, cheat.candidate)
        assert m.status == "incorrect", (m.status, m.error)
        if m.restart_engine:
            restart()
    after = _run(bf16_engine, Candidate.make({"attention": "sdpa"}))
    assert after.status == "ok", after.error
    assert any("check against the float64 forward" in n for n in after.notes), after.notes
