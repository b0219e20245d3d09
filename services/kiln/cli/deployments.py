"""``kiln deployments create|show|list|history|rollback``: deployments through the agent runner's
``kiln.v1.Deployments`` API (docs/design/deployments.md). Errors: one line, exit 1."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import grpc
import typer

from kiln.cli.budget import parse_duration_s
from kiln.cli.context import service_addr, settings_for
from kiln.cli.errors import CliError
from kiln.cli.render import console
from kiln.common.errors import Unavailable, from_rpc_error
from kiln.v1 import common_pb2, deployments_pb2, deployments_pb2_grpc

app = typer.Typer(help="Deployments: continual compilation.", no_args_is_help=True)

STATUS = {
    deployments_pb2.DEPLOYMENT_STATUS_CREATING: "creating",
    deployments_pb2.DEPLOYMENT_STATUS_ACTIVE: "active",
    deployments_pb2.DEPLOYMENT_STATUS_RECOMPILING: "recompiling",
    deployments_pb2.DEPLOYMENT_STATUS_FAILED: "failed",
}


async def call(ctx: typer.Context, method: str, request: object) -> object:
    """``Deployments.<method>(request)`` as this invocation's team (60 s timeout).

    Raises:
        CliError: the agent runner is not reachable. KilnError: the RPC failed.
    """
    from kiln.common.client import team_channel

    settings = settings_for(ctx)
    addr = service_addr(settings, "agent-runner")
    async with team_channel(addr, settings.team) as channel:
        stub = deployments_pb2_grpc.DeploymentsStub(channel)
        try:
            return await getattr(stub, method)(request, timeout=60)
        except grpc.RpcError as err:
            exc = from_rpc_error(err)
            if isinstance(exc, Unavailable):
                raise CliError(f"agent runner at {addr} is not reachable: {exc.message}") from None
            raise exc from None


async def call_stream(ctx: typer.Context, method: str, requests: object) -> object:
    """A client-streaming ``Deployments.<method>`` (no deadline: a replay takes its time)."""
    from kiln.common.client import team_channel

    settings = settings_for(ctx)
    addr = service_addr(settings, "agent-runner")
    async with team_channel(addr, settings.team) as channel:
        stub = deployments_pb2_grpc.DeploymentsStub(channel)
        try:
            return await getattr(stub, method)(requests)
        except grpc.RpcError as err:
            exc = from_rpc_error(err)
            if isinstance(exc, Unavailable):
                raise CliError(f"agent runner at {addr} is not reachable: {exc.message}") from None
            raise exc from None


def _print(text: str) -> None:
    console.print(text, markup=False, highlight=False)


@app.command()
def create(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The deployment's name (unique in your team).")],
    model: Annotated[Path, typer.Option(help="A Hugging Face config.json.")],
    traffic: Annotated[Path, typer.Option(help="The initial traffic: a trace kiln reads.")],
    hardware: Annotated[str, typer.Option(help="Target: cpu, h100, h200, b200.")] = "cpu",
    window: Annotated[str, typer.Option(help="Window length (arrival time): 600, 10m.")] = "10m",
    step: Annotated[str, typer.Option(help="Step between windows (default: 5m).")] = "",
    min_requests: Annotated[int, typer.Option(min=0, help="Fewer: a sparse window.")] = 0,
    threshold: Annotated[float, typer.Option(min=0, help="Drift score that counts.")] = 0.0,
    release: Annotated[float, typer.Option(min=0, help="Score that re-arms.")] = 0.0,
    consecutive: Annotated[int, typer.Option(min=0, help="Drifted windows in a row.")] = 0,
    cooldown: Annotated[str, typer.Option(help="Arrival time between triggers: 30m.")] = "",
    predicted_drop: Annotated[
        float, typer.Option(min=0, max=1, help="Cost-model drop that triggers (0..1).")
    ] = 0.0,
    budget: Annotated[str, typer.Option(help="Each compilation's wall-clock budget.")] = "5m",
    max_experiments: Annotated[int, typer.Option(min=0, help="Per compilation.")] = 0,
    max_recompilations: Annotated[
        int, typer.Option("--max-recompilations", min=0, help="0 = unlimited.")
    ] = 0,
    margin: Annotated[float, typer.Option(min=0, help="Promotion margin (0.05 = 5 %).")] = 0.0,
    agent: Annotated[list[str] | None, typer.Option("--agent", help="Agents to run.")] = None,
    nearby: Annotated[bool, typer.Option(help="Warm-start from nearby workloads too.")] = False,
) -> None:
    """Create a deployment: its first compilation runs now and its winner becomes active."""
    from kiln.cli.compile import build_request
    from kiln.workloads.traffic import read_trace
    from kiln.workloads.traffic.drift import reference_shape
    from kiln.workloads.traffic.windows import WindowSpec

    window_s = parse_duration_s(window)
    step_s = parse_duration_s(step) if step else min(window_s, 300.0)
    submit = build_request(model, traffic, hardware, 0, parse_duration_s(budget), 0, "", [])
    try:
        spec = WindowSpec(length_s=window_s, step_s=step_s, min_requests=min_requests or 50)
    except ValueError as exc:
        raise CliError(f"windows: {exc}") from None
    # The proven shape of the initial traffic: its size-dependent numbers as a window sees them
    # (kiln.workloads.traffic.drift.reference_shape), so a stationary window scores ~0.
    shape = reference_shape(read_trace(traffic).requests, spec, source=traffic.name)
    submit.workload.traffic.CopyFrom(shape.to_proto())
    policy = deployments_pb2.DeploymentPolicy(
        window_s=window_s,
        step_s=step_s,
        min_requests=min_requests,
        threshold=threshold,
        release=release,
        consecutive=consecutive,
        cooldown_s=parse_duration_s(cooldown) if cooldown else 0.0,
        predicted_drop=predicted_drop,
        budget=common_pb2.Budget(
            wall_seconds=parse_duration_s(budget), max_experiments=max_experiments
        ),
        max_recompilations=max_recompilations,
        promotion_margin=margin,
        agents=agent or [],
        nearby=nearby,
    )
    request = deployments_pb2.CreateDeploymentRequest(
        name=name, workload=submit.workload, policy=policy
    )
    d = asyncio.run(call(ctx, "Create", request))
    assert isinstance(d, deployments_pb2.Deployment)
    _print(
        f"{d.name}: {STATUS.get(d.status, '?')} (id {d.deployment_id}); first compilation "
        f"{d.current_recompilation.compilation_id or '(starting)'}; "
        f"`kiln deployments show {d.name}`"
    )


def _show(d: deployments_pb2.Deployment) -> None:
    p = d.policy
    _print(f"deployment {d.name} (team {d.team}, id {d.deployment_id})")
    _print(f"  status        {STATUS.get(d.status, '?')}{' — ' + d.reason if d.reason else ''}")
    _print(f"  model         {d.model.name} on {d.hardware.name}")
    _print(
        f"  policy        windows {p.window_s:g}/{p.step_s:g} s, threshold {p.threshold:g} "
        f"(release {p.release:g}), {p.consecutive} in a row, cooldown {p.cooldown_s:g} s, "
        f"budget {p.budget.wall_seconds:g} s, margin {p.promotion_margin:.1%}"
    )
    active = d.active_candidate_id or "-"
    _print(
        f"  active        {active} from {d.active_compilation_id or '-'} "
        f"({d.active_tokens_per_s:.4g} tokens/s)"
    )
    s = d.proven_shape
    _print(
        f"  proven shape  ISL p50 {s.isl_tokens.p50:.0f} p90 {s.isl_tokens.p90:.0f}, OSL p50 "
        f"{s.osl_tokens.p50:.0f}, batch {s.batch_size}, context {s.context_len}, "
        f"{s.arrival_rate_rps:.3g} req/s"
    )
    w = d.last_window
    _print(
        f"  windows       {d.windows_observed} observed"
        + (
            f"; last {w.index}: {w.requests} requests, score {w.score:.2f} ({w.dominant})"
            if d.HasField("last_window")
            else ""
        )
    )
    if d.HasField("last_drift"):
        x = d.last_drift
        pred = f", predicted drop {x.predicted_drop:.1%}" if x.predicted_drop >= 0 else ""
        _print(
            f"  what drifted  window {x.window_index}: {x.dominant} "
            f"{x.dimensions.get(x.dominant, 0):.3g} = {x.score:.2f}x its threshold{pred}"
        )
    if d.HasField("current_recompilation"):
        r = d.current_recompilation
        _print(
            f"  recompiling   {r.compilation_id} ({r.reason}, window {r.window_index}), warm "
            f"from {len(r.warm_start_compilation_ids)}, incumbent {r.incumbent_candidate_id or '-'}"
        )
    if d.HasField("last_verdict"):
        v = d.last_verdict
        what = "promoted" if v.promoted else "declined"
        _print(
            f"  what it bought {what} {v.challenger_candidate_id or '-'} ({v.compilation_id}): "
            f"{v.challenger_median:.4g} vs {v.incumbent_median:.4g} tokens/s ({v.gain:+.1%}, "
            f"noise {v.noise:.1%}){' — ' + v.reason if v.reason else ''}"
        )
    _print(f"  recompilations {d.recompilations}; compilations {', '.join(d.compilation_ids)}")


@app.command()
def show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The deployment's name (team/name for another's).")],
) -> None:
    """What drifted, by how much, what was recompiled and what it bought."""
    d = asyncio.run(call(ctx, "Get", deployments_pb2.GetDeploymentRequest(name=name)))
    assert isinstance(d, deployments_pb2.Deployment)
    _show(d)


@app.command()
def history(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    windows: Annotated[bool, typer.Option(help="Include every traffic window.")] = True,
) -> None:
    """Every event of the deployment, one line each, oldest first."""
    request = deployments_pb2.GetDeploymentRequest(name=name, history=True)
    d = asyncio.run(call(ctx, "Get", request))
    assert isinstance(d, deployments_pb2.Deployment)
    for e in d.history:
        if not windows and e.type == "TrafficWindowObserved":
            continue
        when = e.recorded_at.ToDatetime().strftime("%H:%M:%S") if e.HasField("recorded_at") else ""
        _print(f"{when}  {e.type:<22} {e.summary}")


@app.command("list")
def list_(
    ctx: typer.Context,
    team: Annotated[str, typer.Option(help="Whose (default: yours; '*' every team's).")] = "",
) -> None:
    """Deployments of a team, oldest first."""
    response = asyncio.run(call(ctx, "List", deployments_pb2.ListDeploymentsRequest(team=team)))
    assert isinstance(response, deployments_pb2.ListDeploymentsResponse)
    if not response.deployments:
        _print("no deployments")
        return
    _print(f"{'name':<24} {'team':<12} {'status':<12} {'windows':>7} {'recomp':>6}  active")
    for d in response.deployments:
        _print(
            f"{d.name:<24} {d.team:<12} {STATUS.get(d.status, '?'):<12} {d.windows_observed:>7} "
            f"{d.recompilations:>6}  {d.active_candidate_id or '-'}"
        )


@app.command()
def rollback(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The deployment's name.")],
    reason: Annotated[str, typer.Option(help="Why (recorded).")] = "",
) -> None:
    """Make the previous active candidate active again."""
    request = deployments_pb2.RollbackRequest(name=name, reason=reason)
    d = asyncio.run(call(ctx, "Rollback", request))
    assert isinstance(d, deployments_pb2.Deployment)
    _print(f"{d.name}: active {d.active_candidate_id} from {d.active_compilation_id}")
