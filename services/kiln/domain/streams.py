"""Ledger stream names, defined once: ``<category>-<id>``.

Three categories exist: ``compilation-<compilation id>`` (one compilation's life),
``experiment-<experiment id>`` (one experiment: requested, completed) and
``deployment-<deployment id>`` (one deployment: windows, drift, recompilations, promotions).
The grammar every stream id follows (category ``[a-z][a-z0-9_]*``, id
``[A-Za-z0-9_][A-Za-z0-9_-]*``) is checked by the ledger on append
(:func:`kiln.events.registry.parse_stream_id`); these helpers build and split names, and
:func:`check_id` holds an id to the stricter grammar of the ids kiln makes and accepts (1-128
characters, so it is also a NATS subject token). Stdlib only.
"""

from __future__ import annotations

import re

COMPILATION = "compilation"
EXPERIMENT = "experiment"
DEPLOYMENT = "deployment"
CATEGORIES = (COMPILATION, EXPERIMENT, DEPLOYMENT)
"""Every stream category the ledger holds."""

COMPILATION_PREFIX = COMPILATION + "-"
EXPERIMENT_PREFIX = EXPERIMENT + "-"
DEPLOYMENT_PREFIX = DEPLOYMENT + "-"


def compilation_stream(compilation_id: str) -> str:
    """``compilation-<compilation_id>``."""
    return COMPILATION_PREFIX + compilation_id


def experiment_stream(experiment_id: str) -> str:
    """``experiment-<experiment_id>``."""
    return EXPERIMENT_PREFIX + experiment_id


def deployment_stream(deployment_id: str) -> str:
    """``deployment-<deployment_id>`` (the id: :func:`kiln.domain.deployment.deployment_id`)."""
    return DEPLOYMENT_PREFIX + deployment_id


def stream_suffix(stream_id: str, prefix: str) -> str | None:
    """The id after ``prefix`` in ``stream_id``, or None when it has another prefix."""
    return stream_id[len(prefix) :] if stream_id.startswith(prefix) else None


def compilation_id_in(stream_id: str) -> str | None:
    """The compilation id of a ``compilation-<id>`` stream, else None."""
    return stream_suffix(stream_id, COMPILATION_PREFIX)


def experiment_id_in(stream_id: str) -> str | None:
    """The experiment id of an ``experiment-<id>`` stream, else None."""
    return stream_suffix(stream_id, EXPERIMENT_PREFIX)


_ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,127}$")


class InvalidId(ValueError):
    """A value that cannot name a compilation or an experiment; the message says why."""


def check_id(value: str, what: str = "compilation_id") -> str:
    """``value`` if it can name a compilation or an experiment (a ledger stream id and a NATS
    subject token).

    Raises:
        InvalidId: not 1-128 characters of ``[A-Za-z0-9_-]`` starting with a letter, digit or
            ``_`` (the message names ``what``).
    """
    if not _ID_RE.match(value):
        raise InvalidId(
            f"invalid {what} {value[:140]!r}: expected 1-128 characters of "
            "[A-Za-z0-9_-], not starting with '-'"
        )
    return value
