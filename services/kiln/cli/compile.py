"""``kiln compile``: submit a compilation over gRPC and watch it to the end.

The Submit's notes (``kiln-submit-notes``: e.g. more devices asked for than the engine pools
have) are printed as ``warning:`` lines. Ctrl-C (with ``--one-shot`` too, before kiln is brought
down) asks for the compilation's cancel, which the ledger records (so no later ``kiln up``
resumes it), prints one line saying so and exits 130; a Ctrl-C during the Submit lets the Submit
finish first, so that what it recorded is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import grpc
import typer
from google.protobuf.json_format import MessageToDict
from rich.live import Live
from rich.text import Text

from kiln.baselines.table import Comparison
from kiln.cli.budget import parse_duration_s
from kiln.cli.compile_view import (
    ENDED,
    STATUS_NAMES,
    CompileView,
    comparison_table,
    summary_table,
)
from kiln.cli.compiler_call import rpc_error
from kiln.cli.context import service_addr, settings_for
from kiln.cli.errors import CliError, err_console
from kiln.cli.render import console
from kiln.common.errors import FailedPrecondition, NotFound, from_rpc_error
from kiln.common.identity import SUBMIT_NOTES_METADATA_KEY
from kiln.common.settings import KilnSettings
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.v1 import common_pb2, compiler_pb2, compiler_pb2_grpc

EXIT_BY_STATUS = {
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED: 0,
    compiler_pb2.COMPILATION_STATUS_FAILED: 1,
    compiler_pb2.COMPILATION_STATUS_CANCELLED: 3,
}
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as shells report it."""
CANCEL_REASON = "cancelled with Ctrl-C on `kiln compile`"


def build_request(
    model: Path,
    traffic: Path,
    hardware: str,
    devices: int,
    budget_s: float,
    max_experiments: int,
    compilation_id: str,
    agents: list[str],
    batch: int = 0,
    baselines: list[str] | None = None,
) -> compiler_pb2.SubmitRequest:
    """The SubmitRequest for these files, read and checked here so that a missing file or a
    malformed trace is reported before anything is sent. ``batch`` > 0 replaces the decode batch
    the trace's concurrency gives (the traffic shape's operating point; ISL/OSL stay the
    trace's). ``baselines``: names of :mod:`kiln.baselines` to measure beside the search
    (empty: the hardware's default; ``["none"]``: none).

    Raises:
        CliError: a missing or unreadable file, an unsupported architecture, a malformed trace.
    """
    from kiln.workloads.config import UnsupportedModelError, load_config
    from kiln.workloads.traffic import TraceError, TrafficShape, read_trace

    try:
        config_text = model.read_text()
        config = load_config(model)
    except FileNotFoundError:
        raise CliError(f"model config {model} does not exist") from None
    except (OSError, UnsupportedModelError) as exc:
        raise CliError(f"model config {model}: {exc}") from None
    try:
        shape = TrafficShape.from_trace(read_trace(traffic))
    except FileNotFoundError:
        raise CliError(f"traffic trace {traffic} does not exist") from None
    except (OSError, TraceError) as exc:
        raise CliError(str(exc)) from None
    if batch > 0:
        shape = dataclasses.replace(shape, batch_size=batch)
    return compiler_pb2.SubmitRequest(
        compilation_id=compilation_id,
        workload=common_pb2.Workload(
            model=common_pb2.ModelSpec(name=config.name, config_json=config_text),
            traffic=shape.to_proto(),
            hardware=common_pb2.HardwareTarget(name=hardware, num_devices=devices),
        ),
        budget=common_pb2.Budget(wall_seconds=budget_s, max_experiments=max_experiments),
        agents=agents,
        baselines=baselines or [],
    )


async def submit_and_watch(
    settings: KilnSettings,
    request: compiler_pb2.SubmitRequest,
    detach: bool,
    as_json: bool,
    comparison: Comparison | None = None,
    view: CompileView | None = None,
) -> compiler_pb2.Compilation:
    """Submit, then (unless ``detach``) follow Watch until the compilation ends; returns the
    last snapshot; ``comparison`` (when given) folds every event for the baselines table,
    ``view`` (when given) every event for the progress display and the summary's move effects.
    gRPC failures arrive as KilnError subclasses."""
    from kiln.common.client import team_channel

    addr = service_addr(settings, "agent-runner")
    async with team_channel(addr, settings.team) as channel:
        stub = compiler_pb2_grpc.CompilerStub(channel)
        submit = asyncio.ensure_future(_submit(stub, request))
        try:
            compilation, notes = await asyncio.shield(submit)
        except asyncio.CancelledError:  # Ctrl-C: let the Submit end, so its record is cancelled
            with contextlib.suppress(Exception):
                await asyncio.wait_for(submit, 60)
            raise
        except grpc.RpcError as err:
            raise rpc_error(err, addr) from None
        for note in notes:
            err_console.print(Text(f"warning: {note}", style="yellow"))
        if detach:
            return compilation
        view = view or CompileView(compilation.compilation_id, request.budget.wall_seconds)
        view.snapshot = compilation
        watch = stub.Watch(compiler_pb2.WatchRequest(compilation_id=compilation.compilation_id))
        try:
            with _live(view, enabled=not as_json) as refresh:
                async for event in watch:
                    view.update(event)
                    if comparison is not None:
                        detail = MessageToDict(event.detail) if event.HasField("detail") else {}
                        comparison.update(event.type, detail)
                    if as_json:
                        print(json.dumps(_event_json(event)), flush=True)
                    refresh()
                    if view.ended:
                        break
        except grpc.RpcError as err:
            raise rpc_error(err, addr) from None
        finally:
            watch.cancel()
        assert view.snapshot is not None
        return view.snapshot


async def _submit(
    stub: compiler_pb2_grpc.CompilerStub, request: compiler_pb2.SubmitRequest
) -> tuple[compiler_pb2.Compilation, list[str]]:
    """Submit; the compilation and the Submit's notes."""
    call: Any = stub.Submit(request, timeout=60)
    compilation = await call
    trailing = dict(await call.trailing_metadata() or ())
    try:
        notes = json.loads(trailing.get(SUBMIT_NOTES_METADATA_KEY) or "[]")
    except ValueError:
        notes = []
    return compilation, [str(n) for n in notes] if isinstance(notes, list) else []


async def cancel_compilation(settings: KilnSettings, compilation_id: str) -> str:
    """Ask for ``compilation_id``'s cancel (Ctrl-C) and wait for the answer (the runner
    records the end within its ``cancel_wait_s``); the one line to print."""
    from kiln.common.client import team_channel

    addr = service_addr(settings, "agent-runner")
    request = compiler_pb2.CancelRequest(compilation_id=compilation_id, reason=CANCEL_REASON)
    async with team_channel(addr, settings.team) as channel:
        try:
            snap = await compiler_pb2_grpc.CompilerStub(channel).Cancel(request, timeout=30)
        except grpc.RpcError as err:
            exc = from_rpc_error(err)
            if isinstance(exc, NotFound):
                return f"interrupted before compilation {compilation_id} was recorded: nothing ran"
            if isinstance(exc, FailedPrecondition):
                return f"interrupted; {exc.message}"
            return (
                f"interrupted, but the cancel of compilation {compilation_id} failed "
                f"({exc.code.name}: {exc.message}); stop it with "
                f"`kiln compilations cancel {compilation_id}`"
            )
    if snap.status == compiler_pb2.COMPILATION_STATUS_CANCELLED:
        return f"cancelled compilation {compilation_id} (Ctrl-C)"
    return (
        f"cancel of compilation {compilation_id} recorded (Ctrl-C); it is still "
        f"{STATUS_NAMES.get(snap.status, '?')} and stops shortly"
    )


class _Interrupted(Exception):
    """Ctrl-C ended the watch; ``line`` says what became of the compilation."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


@dataclasses.dataclass
class _CancelAsked:
    """Whether the Ctrl-C's cancel was asked inside the watch's loop (a KeyboardInterrupt after
    it is a second Ctrl-C)."""

    asked: bool = False


async def _watch_until_interrupted(
    settings: KilnSettings,
    request: compiler_pb2.SubmitRequest,
    cancel: _CancelAsked,
    *args: Any,
) -> compiler_pb2.Compilation:
    """``submit_and_watch``; on Ctrl-C (asyncio cancels the task) the cancel is asked in the same
    event loop (a second loop would get the first one's late gRPC completions), then
    ``_Interrupted``."""
    try:
        return await submit_and_watch(settings, request, *args)
    except asyncio.CancelledError:
        cancel.asked = True
        raise _Interrupted(await _cancel_line(settings, request.compilation_id)) from None


async def _cancel_line(settings: KilnSettings, compilation_id: str) -> str:
    """:func:`cancel_compilation`'s line, or the one line saying it failed."""
    try:
        return await cancel_compilation(settings, compilation_id)
    except Exception as exc:  # e.g. no certificate: still one line, still 130
        return f"interrupted, but the cancel of compilation {compilation_id} failed: {exc}"


def _interrupted(
    settings: KilnSettings, compilation_id: str, cancel: _CancelAsked, line: str = ""
) -> NoReturn:
    """After Ctrl-C: the cancel's ``line`` (asked here in a loop of its own when the interrupt
    came outside the watch's loop), printed as one line; exit 130."""
    again = (
        f"interrupted again: compilation {compilation_id} may still run; stop it with "
        f"`kiln compilations cancel {compilation_id}`"
    )
    if not line and cancel.asked:
        line = again
    elif not line:
        try:
            line = asyncio.run(_cancel_line(settings, compilation_id))
        except KeyboardInterrupt:
            line = again
    err_console.print(line, markup=False, highlight=False)
    raise typer.Exit(EXIT_INTERRUPTED)


@contextlib.contextmanager
def _live(view: CompileView, enabled: bool) -> Iterator[Callable[[], None]]:
    """The progress display: a redrawn panel on a terminal; elsewhere (a log file, CI) one
    plain line per event, with the seconds since the watch began."""
    if not enabled:
        yield lambda: None
        return
    if not err_console.is_terminal:

        def log_line() -> None:
            if view.latest:
                elapsed = time.monotonic() - view.started
                err_console.print(f"[{elapsed:6.1f} s] {view.latest}", markup=False)

        yield log_line
        return
    with Live(view, console=err_console, refresh_per_second=4, transient=True) as live:
        yield live.refresh


def _event_json(event: compiler_pb2.CompilationEvent) -> dict[str, object]:
    return MessageToDict(event, preserving_proto_field_name=True)


def compile(
    ctx: typer.Context,
    model: Annotated[Path, typer.Option(help="A Hugging Face config.json.")],
    traffic: Annotated[Path, typer.Option(help="A trace: Azure CSV or Mooncake JSONL.")],
    hardware: Annotated[str, typer.Option(help="Target: cpu, h100, h200, b200.")] = "cpu",
    devices: Annotated[int, typer.Option(min=0, help="Devices (0 = the target's default).")] = 0,
    budget: Annotated[
        str,
        typer.Option(
            help="The search's wall-clock budget: 300, 90s, 5m, 1h30m (baselines run after it)."
        ),
    ] = "5m",
    max_experiments: Annotated[
        int, typer.Option(min=0, help="Stop after this many experiments (0 = no limit).")
    ] = 0,
    compilation_id: Annotated[
        str, typer.Option("--id", help="Choose the compilation id (default: assigned).")
    ] = "",
    agent: Annotated[
        list[str] | None,
        typer.Option(
            "--agent",
            help="Agents to run (default: coordinate, optuna, profiler, combiner).",
        ),
    ] = None,
    detach: Annotated[bool, typer.Option(help="Submit and return without watching.")] = False,
    one_shot: Annotated[
        bool,
        typer.Option(
            "--one-shot",
            help="Bring kiln up (embedded default) first and down afterwards, unless it was "
            "already running.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Watch events as JSON lines.")] = False,
    batch: Annotated[
        int,
        typer.Option(
            min=0, help="Decode batch to optimise for (0 = from the trace's concurrency)."
        ),
    ] = 0,
    baselines: Annotated[
        str,
        typer.Option(
            help="Baselines measured side by side in the same run: comma-separated of "
            "hf_eager, hf_static, hf_compile, gpt_fast, or all / none (default: all on a GPU "
            "target, none on cpu)."
        ),
    ] = "",
) -> None:
    """Compile a model for a traffic shape on a hardware target: agents propose forward-pass
    variants, engines measure them, the fastest correct one wins. Exit 0 when it succeeded, 1
    when it failed, 3 when it was cancelled, 130 on Ctrl-C (which cancels it)."""
    try:
        budget_s = parse_duration_s(budget)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--budget") from None
    request = build_request(
        model,
        traffic,
        hardware,
        devices,
        budget_s,
        max_experiments,
        compilation_id,
        agent or [],
        batch=batch,
        baselines=_baseline_names(baselines),
    )
    # Chosen here, so that a Ctrl-C at any point can name what to cancel.
    request.compilation_id = request.compilation_id or uuid.uuid4().hex
    settings = settings_for(ctx)
    with _one_shot(settings, enabled=one_shot):
        comparison = Comparison(REFERENCE_CANDIDATE.id)
        view = CompileView(request.compilation_id, request.budget.wall_seconds)
        cancel = _CancelAsked()
        try:
            final = asyncio.run(
                _watch_until_interrupted(
                    settings, request, cancel, detach, as_json, comparison, view
                )
            )
        except _Interrupted as stop:  # before a one-shot's `kiln down`
            _interrupted(settings, request.compilation_id, cancel, stop.line)
        except KeyboardInterrupt:  # outside the watch's loop, or a second Ctrl-C
            _interrupted(settings, request.compilation_id, cancel)
    if detach:
        console.print(
            f"submitted {final.compilation_id}; see it with "
            f"`kiln compilations show {final.compilation_id}`"
        )
        return
    if not as_json:
        console.print(summary_table(final, view.move_effects()))
        compared = comparison_table(comparison, final)
        if compared is not None:
            console.print(compared)
    if final.status in ENDED:
        raise typer.Exit(EXIT_BY_STATUS.get(final.status, 1))


def _baseline_names(text: str) -> list[str]:
    """``--baselines`` as names (``none`` kept, so the server measures none).

    Raises:
        typer.BadParameter: an unknown name.
    """
    from kiln.domain.baselines import parse_names

    if not text.strip():
        return []
    try:
        names = parse_names(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--baselines") from None
    return names or ["none"]


@contextlib.contextmanager
def _one_shot(settings: KilnSettings, enabled: bool) -> Iterator[None]:
    """``kiln up`` before and ``kiln down`` after, when asked and when kiln was not running."""
    if not enabled:
        yield
        return
    from kiln.embedded.supervisor import Supervisor

    supervisor = Supervisor(settings)
    was_running = all(row.healthy for row in supervisor.status())
    if not was_running:
        with err_console.status("starting kiln (embedded NATS, PostgreSQL and four services)..."):
            supervisor.up(start_services=True)
    try:
        yield
    finally:
        if not was_running:
            with err_console.status("stopping kiln..."):
                supervisor.down()
