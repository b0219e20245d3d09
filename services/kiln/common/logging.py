"""Structured logs: one JSON object per line on stderr, from structlog and stdlib logging alike.

Every line carries ``timestamp`` (ISO 8601, UTC), ``level``, ``logger``, ``service`` and
``event``, plus whatever is bound with :func:`structlog.contextvars.bind_contextvars` in the
current context: the server runtime binds ``team``, ``method`` and ``correlation_id`` for each
RPC; domain code binds ``compilation_id`` / ``event_id`` the same way (or with
:func:`structlog.contextvars.bound_contextvars`). Records of stdlib loggers (grpc, alembic,
sqlalchemy, ``warnings``) pass through the same processors, so they are JSON too.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

_LEVEL_ALIASES = {"warn": "WARNING", "fatal": "CRITICAL"}


class _StderrHandler(logging.StreamHandler[TextIO]):
    """A stream handler that writes to whatever ``sys.stderr`` is at emit time (so replacing
    stderr, as pytest does, never leaves it writing to a closed stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass


def parse_level(level: str | int) -> int:
    """The stdlib level number of ``level`` ("debug", "INFO", "warn", 20, ...).

    Raises:
        ValueError: an unknown level name.
    """
    if isinstance(level, int):
        return level
    name = level.strip().upper()
    name = _LEVEL_ALIASES.get(name.lower(), name)
    number = logging.getLevelNamesMapping().get(name)
    if number is None:
        raise ValueError(
            f"unknown log level {level!r}: use debug, info, warning, error or critical"
        )
    return number


_FIRST_KEYS = ("timestamp", "level", "service", "logger", "event")


def _key_order(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Put the fixed keys first, so JSON lines read well by eye too."""
    first = {k: event_dict.pop(k) for k in _FIRST_KEYS if k in event_dict}
    return {**first, **event_dict}


def _add_service(service: str) -> Processor:
    def add_service(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
        event_dict.setdefault("service", service)
        return event_dict

    return add_service


def configure_logging(
    level: str | int = "info",
    fmt: Literal["json", "console"] = "json",
    service: str = "kiln",
) -> None:
    """Send structlog and stdlib logging to stderr as JSON lines (or coloured console text).

    Safe to call again (e.g. by several services in one test process): the handler installed
    by a previous call is replaced; handlers installed by others (pytest's) are kept.

    Args:
        level: minimum level, by name or number.
        fmt: ``"json"`` for machines, ``"console"`` for people at a terminal.
        service: value of the ``service`` key on every line.

    Raises:
        ValueError: an unknown level or format.
    """
    if fmt not in ("json", "console"):
        raise ValueError(f"unknown log format {fmt!r}: use 'json' or 'console'")
    number = parse_level(level)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _add_service(service),
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    renderer: list[Processor]
    if fmt == "json":
        renderer = [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            _key_order,
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _StderrHandler()
    handler.setFormatter(formatter)
    handler.set_name("kiln")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "kiln"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(number)
    logging.captureWarnings(True)


def get_logger(name: str, **initial: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger named ``name`` (the ``logger`` key), with ``initial`` values bound."""
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name, **initial)
    return logger
