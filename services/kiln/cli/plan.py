"""``kiln plan``: ask the cost model (``kiln.v1.CostModel.Plan``) how to deploy a model for a
traffic shape on N GPUs of a kind, without running a compilation.

The workload is built as ``kiln compile`` builds it (:func:`kiln.cli.compile.build_request`)
from a config file and a trace, or from ``--batch/--isl/--osl`` alone (kiln's defaults for any
not given: batch 1, ISL 1,024, OSL 256); those flags override a trace's operating point. Prints
the objective, then the ranked plans as a table (``--frontier``: the Pareto frontier by TPOT;
``--explain``: how the first plan's numbers were derived; ``--json``: the ``PlanResponse`` as one
JSON object), and with ``--format vllm|sglang|trtllm --out DIR`` writes the first plan's launch
configuration (:mod:`kiln.export.serving`). No feasible plan: the pruning reasons, then one
error line and exit 1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, cast

import grpc
import typer
from google.protobuf.json_format import MessageToDict
from rich import box
from rich.table import Table
from rich.text import Text

from kiln.cli.context import service_addr, settings_for
from kiln.cli.errors import USAGE, CliError, err_console
from kiln.cli.render import console, print_json_lines
from kiln.common.errors import Unavailable, from_rpc_error
from kiln.v1 import common_pb2, cost_model_pb2, cost_model_pb2_grpc

if TYPE_CHECKING:
    from kiln.common.settings import KilnSettings
    from kiln.export.serving import Format

TIMEOUT_S = 30.0
"""Deadline of each call (the service gives up planning after 8 s)."""
MAX_REASONS = 5
"""Kinds of pruning reason (memory, heads, layers, ...) printed when no plan is feasible."""
MEETS, MISSES, FRONTIER = "✓", "✗", "★"
PLAN_WIDTH = 14
"""Columns of the table's plan label; longer labels wrap onto more lines (80 columns in all)."""
NOT_MODELLED = "–"
"""Shown for a p90 the serving model did not compute (the plan got one-step estimates only)."""


class LaunchFormat(StrEnum):
    """The engines ``--format`` writes a launch configuration for (kiln.export.serving)."""

    vllm = "vllm"
    sglang = "sglang"
    trtllm = "trtllm"


# ------------------------------------------------------------------------------- the workload


def _model_spec(model: Path) -> common_pb2.ModelSpec:
    """The model of ``model`` (a config.json), named and checked as ``kiln compile`` does.

    Raises:
        CliError: a missing or unreadable file, an unsupported architecture.
    """
    from kiln.workloads.config import UnsupportedModelError, load_config

    try:
        text = model.read_text()
        config = load_config(model)
    except FileNotFoundError:
        raise CliError(f"model config {model} does not exist") from None
    except (OSError, UnicodeDecodeError, UnsupportedModelError) as exc:
        raise CliError(f"model config {model}: {exc}") from None
    return common_pb2.ModelSpec(name=config.name, config_json=text)


def _point(tokens: int) -> common_pb2.Distribution:
    """Every request ``tokens`` long."""
    t = float(tokens)
    return common_pb2.Distribution(p50=t, p90=t, p99=t, mean=t, max=t)


def plan_workload(
    model: Path,
    hardware: str,
    *,
    devices: int = 0,
    traffic: Path | None = None,
    batch: int = 0,
    isl: int = 0,
    osl: int = 0,
    dtype: str = "",
) -> common_pb2.Workload:
    """The workload to plan: ``model`` and ``traffic`` read as ``kiln compile`` reads them, or,
    without a trace, a shape of ``batch`` users sending ``isl``-token prompts for ``osl`` tokens.
    Non-zero ``batch``, ``isl``, ``osl`` override the trace's operating point (ISL and OSL then
    are every request's, and the context is recomputed from them); zero ones without a trace
    take kiln's defaults (:mod:`kiln.domain.operating_point`).

    Raises:
        CliError: a missing or unreadable file, an unsupported architecture, a malformed trace.
    """
    from kiln.domain.operating_point import (
        DEFAULT_BATCH,
        DEFAULT_ISL,
        DEFAULT_OSL,
        operating_context_len,
    )

    if traffic is not None:
        from kiln.cli.compile import build_request

        submit = build_request(model, traffic, hardware, devices, 0.0, 0, "", [], batch=batch)
        workload = submit.workload
    else:
        workload = common_pb2.Workload(
            model=_model_spec(model),
            traffic=common_pb2.TrafficShape(source="synthetic", batch_size=batch or DEFAULT_BATCH),
            hardware=common_pb2.HardwareTarget(name=hardware, num_devices=devices),
        )
        isl, osl = isl or DEFAULT_ISL, osl or DEFAULT_OSL
    shape = workload.traffic
    if isl:
        shape.isl_tokens.CopyFrom(_point(isl))
    if osl:
        shape.osl_tokens.CopyFrom(_point(osl))
    if isl or osl:
        shape.context_len = operating_context_len(shape.isl_tokens.p50, shape.osl_tokens.p50)
    workload.model.dtype = dtype
    return workload


# ------------------------------------------------------------------------------------ the calls


def _rpc_error(err: grpc.RpcError, addr: str) -> Exception:
    exc = from_rpc_error(err)
    if isinstance(exc, Unavailable):
        return CliError(f"cost model at {addr} is not reachable; start kiln with `kiln up`")
    return exc


async def ask(
    settings: KilnSettings,
    request: cost_model_pb2.PlanRequest,
    *,
    frontier: bool = False,
    max_plans: int = 0,
    explain: bool = False,
) -> tuple[cost_model_pb2.PlanResponse, list[common_pb2.ParallelismPlan], str]:
    """``CostModel.Plan(request)`` as the settings' team; returns the answer, the plans to show
    (:func:`shown_plans`) and, with ``explain``, ``CostModel.Explain``'s text for the first of
    them ("" otherwise or without a plan).

    Raises:
        CliError: the cost model is not reachable. KilnError: a call failed (NOT_FOUND for an
            unknown hardware, INVALID_ARGUMENT for a bad target or model, ...).
    """
    from kiln.common.client import team_channel

    addr = service_addr(settings, "cost-model")
    async with team_channel(addr, settings.team) as channel:
        stub = cost_model_pb2_grpc.CostModelStub(channel)
        try:
            response = await stub.Plan(request, timeout=TIMEOUT_S)
            plans = shown_plans(response.plans, frontier=frontier, max_plans=max_plans)
            text = ""
            if explain and plans:
                first = plans[0]
                degrees = common_pb2.ParallelismPlan(
                    tp=first.tp,
                    ep=first.ep,
                    dp=first.dp,
                    pp=first.pp,
                    dcp=first.dcp,
                    moe_tp=first.moe_tp,
                    kv_cache_dtype=first.kv_cache_dtype,
                    batch_size=first.batch_size,
                )
                explained = await stub.Explain(
                    cost_model_pb2.ExplainRequest(
                        workload=request.workload, plan=degrees, targets=request.targets
                    ),
                    timeout=TIMEOUT_S,
                )
                text = explained.text
        except grpc.RpcError as err:
            raise _rpc_error(err, addr) from None
    return response, plans, text


def shown_plans(
    plans: Sequence[common_pb2.ParallelismPlan], *, frontier: bool = False, max_plans: int = 0
) -> list[common_pb2.ParallelismPlan]:
    """The plans in the service's ranking, or (``frontier``) only the Pareto-optimal ones by
    TPOT, fastest first; at most ``max_plans`` (0: all)."""
    shown = list(plans)
    if frontier:
        shown = sorted(
            (p for p in shown if p.pareto_optimal),
            key=lambda p: (p.tpot_ms, -p.throughput_per_device),
        )
    return shown[: max_plans or None]


# ------------------------------------------------------------------------------------- showing


def label(plan: common_pb2.ParallelismPlan) -> str:
    """The plan's degrees above 1, e.g. ``tp4 ep4 dp2`` (``tp1`` for a single GPU), then
    ``etpN`` (each expert split N ways) and ``kv fp8`` where they apply."""
    degrees = [(n, getattr(plan, n) or 1) for n in ("tp", "ep", "dp", "pp", "dcp")]
    parts = [f"{n}{d}" for n, d in degrees if d > 1 or n == "tp"]
    if plan.moe_tp > 1:
        parts.append(f"etp{plan.moe_tp}")
    kv = plan.kv_cache_dtype
    if kv and kv not in ("bfloat16", "auto"):
        parts.append("kv fp8" if kv.startswith("float8") else f"kv {kv}")
    return " ".join(parts)


def devices(plan: common_pb2.ParallelismPlan) -> int:
    """GPUs the plan occupies: tp x pp x dp (EP and DCP split those ranks' work)."""
    return max(1, plan.tp) * max(1, plan.pp) * max(1, plan.dp)


def _ms(x: float) -> str:
    if x < 10:
        return f"{x:.2f}"
    if x < 100:
        return f"{x:.1f}"
    return f"{x:,.0f}"


def _latency(p50: float, p90: float) -> str:
    return f"{_ms(p50)} ({_ms(p90) if p90 else NOT_MODELLED})"


def plans_table(plans: Sequence[common_pb2.ParallelismPlan], title: str | None = None) -> Table:
    """One row per plan, in order: degrees, GPUs, TPOT and TTFT p50 (p90) ms, output tokens/s
    (in all and per GPU), memory GB per GPU, whether it meets the targets and whether it is on
    the Pareto frontier. Fits 80 columns (one space between columns; a long label wraps)."""
    table = Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 0),
    )
    table.add_column("plan", max_width=PLAN_WIDTH, overflow="fold")  # long MoE labels wrap
    for name in (
        "GPUs",
        "TPOT ms\np50 (p90)",
        "TTFT ms\np50 (p90)",
        "tokens/s\ntotal",
        "tokens/s\nper GPU",
        "GB\nper GPU",
    ):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("SLO", justify="center", no_wrap=True)
    table.add_column("Pareto", justify="center", no_wrap=True)
    for p in plans:
        table.add_row(
            label(p),
            str(devices(p)),
            _latency(p.tpot_ms, p.tpot_p90_ms),
            _latency(p.ttft_ms, p.ttft_p90_ms),
            f"{p.throughput_tokens_per_s:,.0f}",
            f"{p.throughput_per_device:,.0f}",
            f"{p.memory_bytes_per_device / 1e9:.1f}",
            Text(MEETS, style="green") if p.meets_targets else Text(MISSES, style="red"),
            Text(FRONTIER, style="yellow") if p.pareto_optimal else "",
        )
    return table


def hardware_summary(hardware_source: str) -> str:
    """The first part of the service's ``hardware_source``: the kind in words (the rest cites
    every figure)."""
    return hardware_source.split(" — ", 1)[0]


def workload_line(workload: common_pb2.Workload) -> str:
    """What was planned, e.g. ``llama-3.2-1b on 8 × h200: batch 1, ISL 1024, OSL 256, context
    1152 (synthetic)``: the operating point the cost model derives from the traffic."""
    from kiln.domain.operating_point import OperatingPoint

    traffic = MessageToDict(workload.traffic, preserving_proto_field_name=True)
    point = OperatingPoint.from_traffic(traffic).point
    return (
        f"{workload.model.name} on {_where(workload)}: batch {point.batch_size}, "
        f"ISL {point.isl}, OSL {point.osl}, context {point.context_len} "
        f"({workload.traffic.source or 'synthetic'})"
    )


def _where(workload: common_pb2.Workload) -> str:
    n, hw = workload.hardware.num_devices, workload.hardware.name
    return f"{n} × {hw}" if n else f"one node of {hw}"


def pruned_reasons(
    pruned: Sequence[common_pb2.ParallelismPlan], top: int = MAX_REASONS
) -> list[str]:
    """Why plans were pruned, one line per kind of reason (``memory``, ``heads``, ``layers``,
    ...: a reason is "kind: detail", several joined by "; "), the kinds pruning the most plans
    first, at most ``top``; each names how many plans it pruned and the detail for the plan
    needing the least memory among them (the one closest to fitting)."""
    kinds: dict[str, list[tuple[int, str]]] = {}  # kind -> (index in pruned, detail)
    for i, p in enumerate(pruned):
        for part in (p.infeasible_reason or "unknown: no reason given").split("; "):
            kind, _, detail = part.partition(": ")
            kinds.setdefault(kind, []).append((i, detail or part))
    lines = []
    for kind, group in sorted(kinds.items(), key=lambda kv: -len(kv[1]))[:top]:
        i, detail = min(group, key=lambda g: pruned[g[0]].memory_bytes_per_device)
        count = f"{len(group)} plan{'s' if len(group) != 1 else ''}"
        lines.append(f"{kind} ({count}), e.g. {label(pruned[i])}: {detail}")
    return lines


def _say(text: str, *, to_stderr: bool = False) -> None:
    (err_console if to_stderr else console).print(
        text, markup=False, highlight=False, soft_wrap=True
    )


def _no_plan(
    response: cost_model_pb2.PlanResponse, workload: common_pb2.Workload, *, quiet: bool
) -> CliError:
    """Print why every plan was pruned (unless ``quiet``: the JSON has them), and return the
    one-line error that ends the command."""
    reasons = pruned_reasons(response.pruned)
    if reasons and not quiet:
        _say(f"every plan was pruned ({len(response.pruned)}):")
        for reason in reasons:
            _say(f"  {reason}")
        _say("  (--json lists every plan and its reasons)")
    return CliError(f"no feasible plan for {workload.model.name} on {_where(workload)}")


def _response_json(
    response: cost_model_pb2.PlanResponse,
    plans: Sequence[common_pb2.ParallelismPlan],
    explanation: str,
) -> dict[str, Any]:
    shown = cost_model_pb2.PlanResponse()
    shown.CopyFrom(response)
    del shown.plans[:]
    shown.plans.extend(plans)
    out = MessageToDict(shown, preserving_proto_field_name=True)
    out.setdefault("plans", [])  # present when empty: "no feasible plan" reads as plans: []
    out.setdefault("pruned", [])
    if explanation:
        out["explain"] = explanation
    return out


# ------------------------------------------------------------------------------------ the command


def plan(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option(help="A Hugging Face config.json.")],
    hardware: Annotated[
        str, typer.Option(help="GPU kind in the cost model's catalogue: h100, h200, b200, ...")
    ],
    devices: Annotated[
        int, typer.Option(min=0, help="GPUs to plan over (0 = one node of the kind).")
    ] = 0,
    traffic: Annotated[
        Path | None,
        typer.Option(help="A trace (Azure CSV or Mooncake JSONL) giving the operating point."),
    ] = None,
    batch: Annotated[
        int, typer.Option(min=0, help="Users in flight (0 = the trace's, else 1).")
    ] = 0,
    isl: Annotated[
        int, typer.Option(min=0, help="Prompt tokens (0 = the trace's p50, else 1024).")
    ] = 0,
    osl: Annotated[
        int, typer.Option(min=0, help="Output tokens (0 = the trace's p50, else 256).")
    ] = 0,
    dtype: Annotated[
        str, typer.Option(help="Weight dtype, e.g. bfloat16 (default: the config's).")
    ] = "",
    tpot_ms: Annotated[
        float, typer.Option("--tpot-ms", help="TPOT target, ms (0 = kiln's default, 50).")
    ] = 0.0,
    ttft_ms: Annotated[
        float, typer.Option("--ttft-ms", help="TTFT target, ms (0 = kiln's default, 2000).")
    ] = 0.0,
    max_plans: Annotated[
        int, typer.Option("--max-plans", min=0, help="Plans to show (0 = all).")
    ] = 10,
    frontier: Annotated[
        bool,
        typer.Option(help="Only the Pareto frontier (tokens/s per GPU vs TPOT), by TPOT."),
    ] = False,
    explain: Annotated[
        bool, typer.Option(help="Show how the first plan's numbers were derived.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="The cost model's answer as one JSON object.")
    ] = False,
    fmt: Annotated[
        LaunchFormat | None,
        typer.Option("--format", help="Write the first plan's vllm, sglang or trtllm launch."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="With --format: the directory to write (new or empty).")
    ] = None,
    model_path: Annotated[
        str | None,
        typer.Option(
            "--model-path", help="With --format: the model to serve (default: the config's)."
        ),
    ] = None,
) -> None:
    """Ask the cost model for parallelism plans: how to serve a model for a traffic shape on
    GPUs of a kind, ranked by output tokens/s per GPU among the plans meeting the latency
    targets. Exit 1 with one line when no plan is feasible."""
    if fmt is not None and out is None:
        raise CliError("--format needs --out DIR", exit_code=USAGE)
    if fmt is None and out is not None:
        raise CliError("--out applies to --format vllm, sglang or trtllm only", exit_code=USAGE)
    if fmt is None and model_path:
        raise CliError(
            "--model-path applies to --format vllm, sglang or trtllm only", exit_code=USAGE
        )
    if out is not None:
        from kiln.export.artifact import ArtifactError, check_out_dir

        try:
            check_out_dir(out)  # before the call: a bad --out costs no round trip
        except ArtifactError as exc:
            raise CliError(str(exc)) from None
    workload = plan_workload(
        model,
        hardware,
        devices=devices,
        traffic=traffic,
        batch=batch,
        isl=isl,
        osl=osl,
        dtype=dtype,
    )
    request = cost_model_pb2.PlanRequest(
        workload=workload,
        max_plans=0 if frontier else max_plans,  # the frontier may reach past the first few
        targets=cost_model_pb2.ServingTargets(tpot_ms=tpot_ms, ttft_ms=ttft_ms),
    )
    settings = settings_for(ctx)
    response, plans, explanation = asyncio.run(
        ask(settings, request, frontier=frontier, max_plans=max_plans, explain=explain)
    )
    if as_json:
        print_json_lines([_response_json(response, plans, explanation)])
    if not response.plans:
        raise _no_plan(response, workload, quiet=as_json)
    if not as_json:
        _print_plans(response, plans, workload)
        if explanation:
            _say("")
            _say(explanation)
    if fmt is not None and out is not None:
        _write_launch(plans[0], workload, fmt, out, model_path, to_stderr=as_json)


def _print_plans(
    response: cost_model_pb2.PlanResponse,
    plans: Sequence[common_pb2.ParallelismPlan],
    workload: common_pb2.Workload,
) -> None:
    _say(f"objective: {response.objective}")
    _say(workload_line(workload))
    console.print(plans_table(plans))
    _say(f"{MEETS} meets the targets, {FRONTIER} on the Pareto frontier (tokens/s per GPU vs TPOT)")
    if any(not p.tpot_p90_ms or not p.ttft_p90_ms for p in plans):
        _say(f"p90 {NOT_MODELLED}: one decode step and one prompt alone, no serving model")
    if not any(p.meets_targets for p in response.plans):
        _say("no plan meets the targets: the smallest miss first")
    for note in dict.fromkeys(p.note for p in plans if p.note):
        _say(f"note: {note}")
    if response.pruned:
        _say(f"{len(response.pruned)} plans pruned as infeasible (--json lists them)")
    _say(f"hardware: {hardware_summary(response.hardware_source)}")


def _write_launch(
    first: common_pb2.ParallelismPlan,
    workload: common_pb2.Workload,
    fmt: LaunchFormat,
    out: Path,
    model_path: str | None,
    *,
    to_stderr: bool = False,
) -> None:
    """Write ``first``'s launch files of ``fmt`` into ``out``, one line per file (on stderr with
    ``to_stderr``: stdout then holds the JSON alone)."""
    from kiln.cli.export import warn_guessed_path, write_launch_files
    from kiln.export.serving import launch_of, render

    try:
        launch = launch_of(first, workload, model_path)
    except ValueError as exc:
        raise CliError(f"plan {label(first)}: {exc}") from None
    warn_guessed_path(launch)
    for path in write_launch_files(out, render(cast("Format", fmt.value), launch)):
        _say(f"wrote {path}", to_stderr=to_stderr)
