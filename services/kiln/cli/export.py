"""``kiln export COMPILATION_ID --out DIR [--candidate ID]``: write the artifact of a
compilation's best (full-tier confirmed) candidate (:mod:`kiln.export.from_ledger`), signed with
the deployment's key (``KILN_STATE_DIR/pki/signing.key``, created on first use); load it with
``kiln.load_optimized(DIR)`` or re-time it with ``python -m kiln.export.reproduce DIR``.

``--format vllm|sglang|trtllm [--model-path P]``: instead, the compilation's parallelism plan
(``Compiler.Get`` as the CLI's team) as that engine's ``launch.sh`` and configuration
(:mod:`kiln.export.serving`); one line per file written."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from kiln.cli.errors import USAGE, CliError, err_console
from kiln.cli.render import console
from kiln.v1 import compiler_pb2

if TYPE_CHECKING:
    from kiln.export.serving import Format, ServingLaunch


class ExportFormat(StrEnum):
    """What ``kiln export`` writes: the signed artifact, or an engine's launch configuration."""

    artifact = "artifact"
    vllm = "vllm"
    sglang = "sglang"
    trtllm = "trtllm"


def export(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option("--out", help="Directory to write (new or empty).")],
    compilation_id: Annotated[
        str, typer.Argument(help="The compilation's id (or --deployment).")
    ] = "",
    candidate: Annotated[
        str | None,
        typer.Option(
            "--candidate",
            help="A candidate id confirmed on the full tier (default: the compilation's best).",
        ),
    ] = None,
    deployment: Annotated[
        str | None,
        typer.Option("--deployment", help="Export this deployment's active candidate."),
    ] = None,
    fmt: Annotated[
        ExportFormat,
        typer.Option(
            "--format",
            help="artifact (signed, loadable), or the plan as a vllm, sglang or trtllm launch.",
        ),
    ] = ExportFormat.artifact,
    model_path: Annotated[
        str | None,
        typer.Option(
            "--model-path",
            help="Engine formats: the model to serve (default: the config's _name_or_path).",
        ),
    ] = None,
) -> None:
    """Export a compilation's winner (or a deployment's active candidate) as a standalone
    artifact directory, or its parallelism plan as an engine's launch configuration."""
    from kiln.cli.context import settings_for
    from kiln.cli.ledger import run_with_ledger
    from kiln.engine_pool.settings import EngineSettings
    from kiln.export.from_ledger import ExportError, export_compilation
    from kiln.export.signing import SigningKeyError, deployment_key, key_id

    if fmt is not ExportFormat.artifact and candidate:
        raise CliError("--candidate applies to --format artifact only", exit_code=USAGE)
    if fmt is ExportFormat.artifact and model_path:
        raise CliError(
            "--model-path applies to --format vllm, sglang or trtllm only", exit_code=USAGE
        )
    if deployment:
        compilation_id, candidate = _active_of(ctx, deployment)
    elif not compilation_id:
        raise CliError("name a compilation id, or --deployment NAME")
    if fmt is not ExportFormat.artifact:
        _export_launch(ctx, fmt, compilation_id, out, model_path)
        return
    try:  # the engine limits of this environment (KILN_ENGINE_*), as a pool here would use
        limits = EngineSettings().limits()
    except ValueError as exc:
        raise CliError(f"KILN_ENGINE_* settings: {exc}") from None
    try:
        key = deployment_key(settings_for(ctx).state_dir)
    except (SigningKeyError, OSError) as exc:
        raise CliError(f"signing key: {exc}") from None
    try:
        path, manifest = run_with_ledger(
            ctx,
            lambda c: export_compilation(
                c, compilation_id, out, key=key, candidate_id=candidate, limits=limits
            ),
        )
    except ExportError as exc:
        raise CliError(str(exc)) from None
    m = manifest.measured
    console.print(
        f"wrote {path}: candidate {manifest.candidate_id[:16]}, "
        f"{m.tokens_per_s:,.1f} tokens/s ({m.tier} tier)"
        + (f", {m.speedup:.2f}x" if m.speedup else "")
        + f"; signed by key {key_id(key.public_key())[:16]}",
        markup=False,
        highlight=False,
    )


def _active_of(ctx: typer.Context, name: str) -> tuple[str, str]:
    """(compilation id, candidate id) of the deployment's active candidate."""
    import asyncio

    from kiln.cli.deployments import call
    from kiln.v1 import deployments_pb2

    d = asyncio.run(call(ctx, "Get", deployments_pb2.GetDeploymentRequest(name=name)))
    assert isinstance(d, deployments_pb2.Deployment)
    if not d.active_candidate_id:
        raise CliError(f"deployment {name!r} has no active candidate yet")
    return d.active_compilation_id, d.active_candidate_id


def launch_files(
    compilation: compiler_pb2.Compilation, fmt: ExportFormat, model_path: str | None = None
) -> dict[str, str]:
    """The files of ``compilation``'s plan as a launch of ``fmt`` (an engine format): file name
    -> text; CliError when it has no plan yet or the plan cannot be served."""
    from kiln.export.serving import launch_of, render

    cid = compilation.compilation_id
    if not compilation.HasField("plan") or not compilation.plan.tp:
        raise CliError(f"compilation {cid} has no plan yet")
    try:
        launch = launch_of(compilation.plan, compilation.workload, model_path, compilation_id=cid)
    except ValueError as exc:
        raise CliError(f"compilation {cid}: {exc}") from None
    warn_guessed_path(launch)
    return render(cast("Format", fmt.value), launch)


def warn_guessed_path(launch: ServingLaunch) -> None:
    """One warning line on stderr when the launch's model path is only the model's name."""
    if launch.model_path_guessed:
        err_console.print(
            f"warning: serving {launch.model_path!r}, the model's name (neither --model-path nor"
            " the config's _name_or_path gives a checkpoint): pass --model-path DIR or a hub id",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


def write_launch_files(out: Path, files: dict[str, str]) -> list[Path]:
    """Write ``files`` into ``out`` (new or empty; CliError otherwise), ``launch.sh``
    executable; the paths written."""
    from kiln.export.artifact import ArtifactError, check_out_dir
    from kiln.export.serving import LAUNCH_SCRIPT

    try:
        out_dir = check_out_dir(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, text in files.items():
            path = out_dir / name
            path.write_text(text, encoding="utf-8")
            if name == LAUNCH_SCRIPT:
                os.chmod(path, 0o755)
            paths.append(path)
    except (ArtifactError, OSError) as exc:
        raise CliError(str(exc)) from None
    return paths


def _export_launch(
    ctx: typer.Context, fmt: ExportFormat, compilation_id: str, out: Path, model_path: str | None
) -> None:
    """Get the compilation as the CLI's team, write its plan's launch files into ``out``."""
    import asyncio

    from kiln.cli.compiler_call import call
    from kiln.cli.context import service_addr, settings_for
    from kiln.common.errors import Unavailable
    from kiln.export.artifact import ArtifactError, check_out_dir

    try:
        check_out_dir(out)  # before the call: a bad --out costs no round trip
    except ArtifactError as exc:
        raise CliError(str(exc)) from None
    request = compiler_pb2.GetRequest(compilation_id=compilation_id)
    try:
        compilation = asyncio.run(call(ctx, "Get", request))
    except Unavailable as exc:
        addr = service_addr(settings_for(ctx), "agent-runner")
        raise CliError(f"agent runner at {addr} is not reachable: {exc.message}") from None
    assert isinstance(compilation, compiler_pb2.Compilation)
    for path in write_launch_files(out, launch_files(compilation, fmt, model_path)):
        console.print(f"wrote {path}", markup=False, highlight=False, soft_wrap=True)
