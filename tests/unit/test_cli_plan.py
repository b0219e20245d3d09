"""``kiln plan`` against a real cost model: the service runs in-process (a thread of its own,
over gRPC with the test session's mTLS; it needs no database or NATS) and the command is run
with typer's CliRunner."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import Result
from google.protobuf.json_format import ParseDict
from typer.testing import CliRunner

from kiln.cli import render
from kiln.cli.main import app
from kiln.cli.plan import label, plan_workload, pruned_reasons, shown_plans
from kiln.common.server import serve
from kiln.common.settings import KilnSettings
from kiln.cost_model.app import create_app
from kiln.domain.operating_point import operating_context_len
from kiln.v1 import common_pb2, cost_model_pb2

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
MODELS = DATA / "models"
CONV = DATA / "traces" / "azure_llm_2023_conv.csv"
LLAMA_1B = MODELS / "llama-3.2-1b.json"
LLAMA_8B = MODELS / "llama-3.1-8b.json"

Run = Callable[..., Result]
"""``kiln plan ARGS`` run in-process (the ``kiln_plan`` fixture)."""

pytestmark = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is absent")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def cost_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The address of a CostModel server running in a thread (its own event loop), so that
    the command's ``asyncio.run`` can call it."""
    settings = KilnSettings(
        metrics_port=0,
        grace_period_s=1.0,
        state_dir=tmp_path_factory.mktemp("cost"),
        log_level="error",  # its "planned" lines would land in the captured output
    )
    addr = f"127.0.0.1:{_free_port()}"
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stop: asyncio.Event | None = None
    failed: list[BaseException] = []

    async def main() -> None:
        nonlocal stop
        stop, started = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(
            serve(
                create_app(settings), settings, listen=addr, started=started, handle_signals=False
            )
        )
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            waiter.cancel()
            failed.append(task.exception() or RuntimeError("the server ended"))
            ready.set()
            return
        ready.set()
        await stop.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the cost model did not start"
    if failed:
        raise failed[0]
    try:
        yield addr
    finally:
        assert stop is not None
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()


@pytest.fixture
def kiln_plan(cost_model: str, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Run ``kiln plan ARGS`` against the cost model, on an 80-column console."""
    monkeypatch.setenv("KILN_COST_MODEL_ADDR", cost_model)
    monkeypatch.setenv("KILN_TEAM", "default")  # a team of the session's PKI
    monkeypatch.setattr(render.console, "_width", 80)

    def run(*args: str) -> Result:
        return CliRunner().invoke(app, ["plan", *args])

    return run


def _rows(output: str) -> list[str]:
    """The table's body rows (after the header rule, up to the legend)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line.strip()) == {"─"})
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("tp"):
            break
        body.append(line)
    return body


def test_a_plan_table_for_llama_1b_on_8_h200_at_batch_1(kiln_plan: Run) -> None:
    result = kiln_plan(
        "--model", str(LLAMA_1B), "--hardware", "h200", "--devices", "8", "--batch", "1"
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("objective: most output tokens/s per GPU with TPOT ≤ 50 ms")
    assert "llama-3.2-1b on 8 × h200: batch 1, ISL 1024, OSL 256" in result.stdout
    header = next(line for line in lines if "plan" in line and "GPUs" in line)
    for column in ("p50 (p90)", "total", "per GPU", "SLO", "Pareto"):
        assert column in header or column in result.stdout
    rows = _rows(result.stdout)
    assert len(rows) == 10  # --max-plans defaults to 10
    first = rows[0].split()
    assert first[0] == "tp1" and first[1] == "1"  # one GPU: the most tokens/s per GPU
    assert "✓" in rows[0] and "★" in rows[0]
    table = lines[lines.index(header) - 1 : lines.index(rows[-1]) + 1]
    assert all(len(line) <= 80 for line in table), "\n".join(table)
    assert "…" not in result.stdout  # no cell cut to fit
    assert "hardware: h200 (NVIDIA H200" in result.stdout
    assert result.stderr == ""


def test_a_tight_tpot_target_picks_tensor_parallelism(kiln_plan: Run) -> None:
    argv = ["--model", str(LLAMA_8B), "--hardware", "h200", "--devices", "8", "--tpot-ms", "3"]
    result = kiln_plan(*argv, "--json")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    first = answer["plans"][0]
    assert first["tp"] > 1 and first["meets_targets"] and first["tpot_ms"] <= 3
    assert "TPOT ≤ 3 ms" in answer["objective"]
    table = kiln_plan(*argv)
    assert table.exit_code == 0, table.output
    assert _rows(table.stdout)[0].split()[0] == f"tp{first['tp']}"
    assert "✗" in table.stdout  # tp1 and tp2 miss 3 ms and are ranked after


def test_frontier_shows_only_pareto_plans_by_tpot(kiln_plan: Run) -> None:
    argv = ["--model", str(LLAMA_1B), "--hardware", "h200", "--devices", "8", "--frontier"]
    answer = json.loads(kiln_plan(*argv, "--json").stdout)
    plans = answer["plans"]
    assert plans and all(p["pareto_optimal"] for p in plans)
    tpots = [p["tpot_ms"] for p in plans]
    assert tpots == sorted(tpots)
    result = kiln_plan(*argv)
    assert result.exit_code == 0, result.output
    rows = _rows(result.stdout)
    assert [r.split()[0] for r in rows] == [f"tp{p['tp']}" for p in plans]  # dense: tp only
    assert all("★" in r for r in rows)


def test_json_is_one_object_matching_the_table(kiln_plan: Run) -> None:
    argv = ["--model", str(LLAMA_1B), "--hardware", "h200", "--devices", "8", "--max-plans", "4"]
    result = kiln_plan(*argv, "--json")
    assert result.exit_code == 0, result.output
    (line,) = result.stdout.splitlines()  # one JSON object, one line, as the other --json do
    answer = json.loads(line)
    response = ParseDict(answer, cost_model_pb2.PlanResponse())
    assert len(response.plans) == 4 and response.plans[0].tp == 1
    assert response.hardware_source.startswith("h200")
    table = kiln_plan(*argv)
    assert table.stdout.splitlines()[0] == f"objective: {response.objective}"
    assert [r.split()[0] for r in _rows(table.stdout)] == [
        label(p).split()[0] for p in response.plans
    ]


def test_explain_prints_the_first_plans_terms(kiln_plan: Run) -> None:
    result = kiln_plan(
        "--model", str(LLAMA_1B), "--hardware", "h200", "--devices", "8", "--explain"
    )
    assert result.exit_code == 0, result.output
    assert "tp1 ep1 dp1 pp1 dcp1 on 1 × h200" in result.stdout
    assert "verdict: feasible" in result.stdout and "memory.weights_per_device" in result.stdout


def test_format_vllm_writes_the_first_plans_launch(kiln_plan: Run, tmp_path: Path) -> None:
    out = tmp_path / "launch"
    argv = ["--model", str(LLAMA_8B), "--hardware", "h200", "--tpot-ms", "3"]
    result = kiln_plan(*argv, "--format", "vllm", "--out", str(out), "--model-path", "/ckpt/8b")
    assert result.exit_code == 0, result.output
    wrote = [line for line in result.stdout.splitlines() if line.startswith("wrote ")]
    assert wrote == [f"wrote {out / 'launch.sh'}", f"wrote {out / 'vllm.yaml'}"]
    script = (out / "launch.sh").read_text()
    assert (out / "launch.sh").stat().st_mode & stat.S_IXUSR
    assert "exec vllm serve /ckpt/8b" in script
    first = _rows(result.stdout)[0].split()[0]  # tp4 at 3 ms
    assert f"tensor-parallel-size: {first.removeprefix('tp')}" in (out / "vllm.yaml").read_text()

    again = kiln_plan(*argv, "--format", "vllm", "--out", str(out))
    assert again.exit_code == 1 and "is not an empty directory" in again.stderr
    assert kiln_plan(*argv, "--format", "vllm").exit_code == 2  # usage: --format needs --out

    quiet = kiln_plan(*argv, "--json", "--format", "sglang", "--out", str(tmp_path / "sg"))
    assert quiet.exit_code == 0, quiet.output
    assert json.loads(quiet.stdout)["plans"]  # stdout is the JSON alone
    warning, wrote = quiet.stderr.strip().splitlines()  # no --model-path: warned on stderr
    assert warning.startswith("warning: serving 'llama-3.1-8b', the model's name")
    assert wrote == f"wrote {tmp_path / 'sg' / 'launch.sh'}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--hardware", "h900"], "NOT_FOUND: unknown hardware 'h900'"),
        (["--hardware", "h200", "--tpot-ms", "-1"], "INVALID_ARGUMENT: targets.tpot_ms -1.0"),
        (["--hardware", "h200", "--dtype", "int3"], "INVALID_ARGUMENT: workload.model.dtype"),
        (["--hardware", "h200", "--model", "/nope/config.json"], "does not exist"),
        (["--hardware", "h200", "--traffic", "/nope.csv"], "traffic trace /nope.csv does not"),
        (["--hardware", "h200", "--out", "/tmp/x"], "--out applies to --format"),
    ],
)
def test_bad_input_is_one_line(kiln_plan: Run, args: list[str], message: str) -> None:
    result = kiln_plan("--model", str(LLAMA_1B), *args)
    usage = message.startswith("--")  # a bad combination of options exits 2, as Click does
    assert result.exit_code == (2 if usage else 1), result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], result.output
    assert lines[0].startswith("error: ") and "Traceback" not in result.output


def test_no_feasible_plan_prints_the_reasons_then_one_error(kiln_plan: Run) -> None:
    model = MODELS / "deepseek-v3.json"
    result = kiln_plan("--model", str(model), "--hardware", "h100", "--devices", "4")
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == "error: no feasible plan for deepseek-v3 on 4 × h100"
    reasons = [line.strip() for line in result.stdout.splitlines()[1:] if line.startswith("  ")]
    # deepseek-v3's 671 GB of weights do not fit 4 × 80 GB, whatever the split
    assert reasons[0].startswith("memory (") and "GB per device" in reasons[0]
    assert len(set(reasons)) == len(reasons)
    answer = kiln_plan("--model", str(model), "--hardware", "h100", "--devices", "4", "--json")
    assert answer.exit_code == 1
    parsed = json.loads(answer.stdout)
    assert parsed["plans"] == [] and parsed["pruned"]  # the keys are there when empty


def test_an_unreachable_cost_model_is_one_line(
    cost_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_COST_MODEL_ADDR", "127.0.0.1:1")
    result = CliRunner().invoke(app, ["plan", "--model", str(LLAMA_1B), "--hardware", "h200"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: cost model at 127.0.0.1:1 is not reachable; start kiln with `kiln up`"]


# ------------------------------------------------------------------- the pieces, without a server


def test_the_workload_without_a_trace_and_overrides_of_one() -> None:
    w = plan_workload(LLAMA_1B, "h200", devices=8, batch=4, isl=2000, dtype="bfloat16")
    t = w.traffic
    assert (w.model.name, w.model.dtype, w.hardware.name, w.hardware.num_devices) == (
        "llama-3.2-1b",
        "bfloat16",
        "h200",
        8,
    )
    assert (t.batch_size, t.isl_tokens.p50, t.isl_tokens.p99, t.osl_tokens.p50) == (
        4,
        2000,
        2000,
        256,
    )
    assert t.context_len == 2000 + 128 and t.source == "synthetic"
    if CONV.is_file():
        traced = plan_workload(LLAMA_1B, "h200", traffic=CONV)
        assert traced.traffic.source == CONV.name and traced.traffic.batch_size > 1
        over = plan_workload(LLAMA_1B, "h200", traffic=CONV, batch=1, osl=100)
        assert over.traffic.batch_size == 1 and over.traffic.osl_tokens.max == 100
        assert over.traffic.isl_tokens == traced.traffic.isl_tokens  # not overridden
        want = operating_context_len(traced.traffic.isl_tokens.p50, 100)
        assert over.traffic.context_len == want


def test_pruned_reasons_are_one_line_per_kind() -> None:
    def pruned(tp: int, reason: str, gb: float) -> common_pb2.ParallelismPlan:
        return common_pb2.ParallelismPlan(
            tp=tp, infeasible_reason=reason, memory_bytes_per_device=int(gb * 1e9)
        )

    lines = pruned_reasons(
        [
            pruned(1, "memory: needs 300 GB", 300),
            pruned(2, "heads: 3 heads not divisible by tp=2; memory: needs 150 GB", 150),
            pruned(4, "memory: needs 80 GB", 80),
        ]
    )
    assert lines == [
        "memory (3 plans), e.g. tp4: needs 80 GB",
        "heads (1 plan), e.g. tp2: 3 heads not divisible by tp=2",
    ]


def test_shown_plans_frontier_and_limit() -> None:
    plans = [
        common_pb2.ParallelismPlan(tp=1, tpot_ms=3.0, pareto_optimal=True),
        common_pb2.ParallelismPlan(tp=1, dp=2, tpot_ms=3.0),
        common_pb2.ParallelismPlan(tp=2, tpot_ms=2.0, pareto_optimal=True),
    ]
    assert [label(p) for p in shown_plans(plans, max_plans=2)] == ["tp1", "tp1 dp2"]
    assert [label(p) for p in shown_plans(plans, frontier=True)] == ["tp2", "tp1"]
