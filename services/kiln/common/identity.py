"""Team identity and correlation of calls: the gRPC metadata keys and the current call.

Every call to a kiln service carries the caller's team in metadata ``kiln-team`` (and may carry
a correlation and a causation id). The server runtime (:mod:`kiln.common.server`) validates it
and makes it available to handlers through :func:`current_call`, so every event a handler
appends can record who caused it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass

from kiln.common.errors import InvalidArgument, Unauthenticated

TEAM_METADATA_KEY = "kiln-team"
"""gRPC metadata key carrying the caller's team name (required on every kiln call)."""

CORRELATION_METADATA_KEY = "kiln-correlation-id"
"""gRPC metadata key carrying the correlation id (optional; ties a chain of work together)."""

CAUSATION_METADATA_KEY = "kiln-causation-id"
"""gRPC metadata key carrying the causation id (optional; the event or call that caused this)."""

TEAM_RULE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""The rule team names follow: lower-case letters, digits, '.', '_', '-'; 1 to 64 characters,
starting with a letter or digit."""

MAX_ID_CHARS = 128
"""Longest accepted correlation or causation id, characters."""

_TEAM_RE = re.compile(TEAM_RULE)


@dataclass(frozen=True, slots=True)
class CallIdentity:
    """Who made the RPC being handled, and the chain of work it belongs to."""

    team: str
    correlation_id: str | None = None
    causation_id: str | None = None


_CURRENT: ContextVar[CallIdentity | None] = ContextVar("kiln_current_call", default=None)


def validate_team(name: str | None) -> str:
    """Return ``name`` when it is a valid team name.

    Raises:
        Unauthenticated: ``name`` is None or empty (no identity given).
        InvalidArgument: ``name`` breaks :data:`TEAM_RULE`; the message names the rule.
    """
    if not name:
        raise Unauthenticated(f"missing team identity: set gRPC metadata '{TEAM_METADATA_KEY}'")
    if not _TEAM_RE.match(name):
        raise InvalidArgument(
            f"malformed team name {name[:80]!r} in metadata '{TEAM_METADATA_KEY}': team names "
            f"must match {TEAM_RULE} (lower-case letters, digits, '.', '_', '-'; at most 64)"
        )
    return name


def _single(metadata: Iterable[tuple[str, str | bytes]], key: str) -> str | None:
    values = {str(v) for k, v in metadata if k == key}
    if len(values) > 1:
        raise InvalidArgument(f"conflicting values for gRPC metadata '{key}': {sorted(values)}")
    return values.pop() if values else None


def _optional_id(metadata: Iterable[tuple[str, str | bytes]], key: str) -> str | None:
    value = _single(metadata, key)
    if not value:
        return None
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InvalidArgument(
            f"gRPC metadata '{key}' must be printable text of at most {MAX_ID_CHARS} characters"
        )
    return value


def identity_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> CallIdentity:
    """Build the :class:`CallIdentity` of a call from its invocation metadata.

    Raises:
        Unauthenticated: no ``kiln-team`` entry.
        InvalidArgument: a malformed team name, conflicting repeated entries, or an over-long
            or unprintable correlation/causation id.
    """
    items = [(k, v) for k, v in (metadata or ())]
    return CallIdentity(
        team=validate_team(_single(items, TEAM_METADATA_KEY)),
        correlation_id=_optional_id(items, CORRELATION_METADATA_KEY),
        causation_id=_optional_id(items, CAUSATION_METADATA_KEY),
    )


def identity_metadata(identity: CallIdentity) -> tuple[tuple[str, str], ...]:
    """The gRPC metadata entries that carry ``identity`` (for clients)."""
    entries = [(TEAM_METADATA_KEY, identity.team)]
    if identity.correlation_id:
        entries.append((CORRELATION_METADATA_KEY, identity.correlation_id))
    if identity.causation_id:
        entries.append((CAUSATION_METADATA_KEY, identity.causation_id))
    return tuple(entries)


def current_call() -> CallIdentity:
    """The identity of the RPC being handled by the current task.

    Raises:
        RuntimeError: called outside an RPC handler (or a :func:`use_call` block).
    """
    identity = _CURRENT.get()
    if identity is None:
        raise RuntimeError(
            "current_call() used outside an RPC handler: the team identity only exists while "
            "kiln's server runtime handles a call (or inside `with use_call(...)`)"
        )
    return identity


def current_call_or_none() -> CallIdentity | None:
    """The identity of the RPC being handled, or None outside one."""
    return _CURRENT.get()


@contextmanager
def use_call(identity: CallIdentity) -> Iterator[CallIdentity]:
    """Make ``identity`` the current call for the block (the server runtime uses this; so may
    background work that acts on behalf of a team)."""
    token = _CURRENT.set(identity)
    try:
        yield identity
    finally:
        # An abandoned async generator is finalized in another context, where the token is
        # foreign; the value then dies with the RPC's own context anyway.
        with suppress(ValueError):
            _CURRENT.reset(token)
