"""How the CLI reports failures: one red ``error: ...`` line on stderr and a non-zero exit, never
a traceback (set ``KILN_DEBUG=1`` to get the traceback of an unexpected error). Usage errors
(unknown flag, a value out of its range) are typer's: its usage box naming the option, exit 2."""

from __future__ import annotations

import os
import sys
from typing import Any

import grpc
import typer
from pydantic import ValidationError
from pydantic_settings import BaseSettings
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from kiln.common.errors import KilnError, from_rpc_error

_CLICK_EXCEPTION: type[Exception] = next(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException"
)  # click's base of usage errors (typer vendors click in newer releases)

err_console = Console(stderr=True, soft_wrap=True, highlight=False)
"""Console for errors and progress (stderr); soft wrap keeps one message on one line."""


USAGE = 2
"""Exit code of a bad combination of options (as Click exits for a bad option); other failures
exit 1."""


class CliError(Exception):
    """A user-facing failure whose message is printed as is."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def print_error(message: str) -> None:
    """Print ``error: <message>`` in red on stderr."""
    err_console.print(Text(f"error: {message}", style="bold red"))


def describe(exc: BaseException) -> str:
    """The one-line (where possible) description of ``exc`` that the CLI prints."""
    if isinstance(exc, CliError):
        return exc.message
    if isinstance(exc, grpc.RpcError) and not isinstance(exc, KilnError):
        exc = from_rpc_error(exc)
    if isinstance(exc, KilnError):
        code = getattr(exc.code, "name", str(exc.code))
        return f"{code}: {exc.message}"
    if isinstance(exc, ValidationError):
        prefix = _env_prefix(exc.title)
        return "invalid settings: " + "; ".join(
            _setting_problem(err, prefix) for err in exc.errors()
        )
    orig = getattr(exc, "orig", None)  # SQLAlchemy's wrapper of a driver error
    if type(exc).__module__.startswith("sqlalchemy") and orig is not None:
        return "database: " + (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    if isinstance(exc, RuntimeError | OSError | ValueError | TimeoutError):
        return str(exc) or type(exc).__name__
    return f"unexpected {type(exc).__name__}: {exc}"


_SETTING_FLAGS = {
    "team": "--team",
    "ledger_addr": "--ledger-addr",
    "listen_addr": "--listen",
    "metrics_port": "--metrics-port",
    "state_dir": "--state-dir",
    "database_url": "--database-url",
}
"""Settings that CLI flags can set too: the flag, named beside the variable in errors."""


def _env_prefix(title: str) -> str:
    """The environment prefix of the settings class named ``title`` (a ValidationError's title):
    ``KILN_QUOTA_`` for ``QuotaSettings`` and so on; ``KILN_`` when no such class is loaded."""
    todo: list[type] = [BaseSettings]
    while todo:
        cls = todo.pop()
        if cls.__name__ == title and cls.__module__.startswith("kiln."):
            prefix = cls.model_config.get("env_prefix")  # type: ignore[attr-defined]
            return str(prefix) if prefix else "KILN_"
        todo.extend(cls.__subclasses__())
    return "KILN_"


def _setting_problem(err: Any, prefix: str = "KILN_") -> str:
    """One pydantic error about a setting: ``name (PREFIX_NAME / --flag): reason``."""
    field = ".".join(str(p) for p in err.get("loc", ())) or "settings"
    source = f"{prefix}{field.upper()}"
    if prefix == "KILN_" and field in _SETTING_FLAGS:
        source += f" / {_SETTING_FLAGS[field]}"
    reason = str(err.get("msg", "invalid"))
    reason = reason.removeprefix("Value error, ")
    return f"{field} ({source}): {reason}"


class KilnGroup(TyperGroup):
    """The root command group: turns any exception a command raises into :func:`print_error`
    and exit status 1 (130 on Ctrl-C; 141, silently, when stdout's reader closed the pipe)."""

    def invoke(self, ctx: Any) -> Any:
        """Run the command, reporting failures as one line."""
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, _CLICK_EXCEPTION):
            raise  # exits, and usage errors that typer prints itself
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except BrokenPipeError:
            # The reader went away (``kiln ... | head``): stop quietly. Later writes (the
            # interpreter's flush at exit) go to devnull, as the Python docs advise (signal
            # module, "Note on SIGPIPE").
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            raise typer.Exit(141) from None
        except Exception as exc:
            if os.environ.get("KILN_DEBUG") and not isinstance(exc, CliError | KilnError):
                raise
            print_error(describe(exc))
            raise typer.Exit(exc.exit_code if isinstance(exc, CliError) else 1) from None
