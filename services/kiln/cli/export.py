"""``kiln export COMPILATION_ID --out DIR [--candidate ID]``: write the artifact of a
compilation's best (full-tier confirmed) candidate (:mod:`kiln.export.from_ledger`), signed with
the deployment's key (``KILN_STATE_DIR/pki/signing.key``, created on first use); load it with
``kiln.load_optimized(DIR)`` or re-time it with ``python -m kiln.export.reproduce DIR``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.errors import CliError
from kiln.cli.render import console


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
) -> None:
    """Export a compilation's winner (or a deployment's active candidate) as a standalone
    artifact directory."""
    from kiln.cli.context import settings_for
    from kiln.cli.ledger import run_with_ledger
    from kiln.engine_pool.settings import EngineSettings
    from kiln.export.from_ledger import ExportError, export_compilation
    from kiln.export.signing import SigningKeyError, deployment_key, key_id

    if deployment:
        compilation_id, candidate = _active_of(ctx, deployment)
    elif not compilation_id:
        raise CliError("name a compilation id, or --deployment NAME")
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
