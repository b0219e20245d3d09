"""Who makes a call: the verified principal, the team it acts for, the chain of work it belongs to.

The principal comes from the client certificate's SAN URI, ``spiffe://kiln/<kind>/<name>``
(kind ``team``, ``service`` or ``operator``; docs/design/security.md). The team of a call follows
from it (:func:`identity_for`): a team principal's own team (metadata ``kiln-team`` naming another
is PERMISSION_DENIED), the ``kiln-team`` a service principal sends, an operator's ``kiln-team`` if
any. With TLS off there is no principal and ``kiln-team`` is trusted as sent. The server runtime
(:mod:`kiln.common.server`) builds the identity and makes it available to handlers through
:func:`current_call`, so every event a handler appends can record who caused it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, cast

from kiln.common.errors import InvalidArgument, PermissionDenied, Unauthenticated

TEAM_METADATA_KEY = "kiln-team"
"""gRPC metadata key carrying the caller's team name (required on every kiln call)."""

CORRELATION_METADATA_KEY = "kiln-correlation-id"
"""gRPC metadata key carrying the correlation id (optional; ties a chain of work together)."""

SUBMIT_NOTES_METADATA_KEY = "kiln-submit-notes"
"""Trailing metadata key of ``Compiler.Submit``: a JSON list of notes for the caller (what the
agent runner could not check, a device count beyond the engine pools')."""

CAUSATION_METADATA_KEY = "kiln-causation-id"
"""gRPC metadata key carrying the causation id (optional; the event or call that caused this)."""

TEAM_RULE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""The rule team names follow: lower-case letters, digits, '.', '_', '-'; 1 to 64 characters,
starting with a letter or digit."""

MAX_ID_CHARS = 128
"""Longest accepted correlation or causation id, characters."""

_TEAM_RE = re.compile(TEAM_RULE)

PrincipalKind = Literal["team", "service", "operator"]
PRINCIPAL_KINDS: tuple[PrincipalKind, ...] = ("team", "service", "operator")
SPIFFE_PREFIX = "spiffe://kiln/"
"""Every kiln principal's URI starts so; then ``<kind>/<name>``, the name following
:data:`TEAM_RULE`."""


@dataclass(frozen=True, slots=True)
class Principal:
    """A verified caller: ``kind`` and ``name`` of its certificate's ``spiffe://kiln/...`` URI."""

    kind: PrincipalKind
    name: str

    @property
    def uri(self) -> str:
        """``spiffe://kiln/<kind>/<name>``."""
        return f"{SPIFFE_PREFIX}{self.kind}/{self.name}"

    def __str__(self) -> str:
        return self.uri


def parse_principal(uri: str) -> Principal:
    """The principal a ``spiffe://kiln/<kind>/<name>`` URI names.

    Raises:
        ValueError: another scheme or trust domain, an unknown kind, or a name breaking
            :data:`TEAM_RULE`.
    """
    if not uri.startswith(SPIFFE_PREFIX):
        raise ValueError(f"{uri[:120]!r} is not a {SPIFFE_PREFIX}<kind>/<name> URI")
    kind, sep, name = uri[len(SPIFFE_PREFIX) :].partition("/")
    if not sep or kind not in PRINCIPAL_KINDS or not _TEAM_RE.match(name):
        raise ValueError(
            f"{uri[:120]!r}: expected {SPIFFE_PREFIX}<team|service|operator>/<name> with the name "
            f"matching {TEAM_RULE}"
        )
    return Principal(cast(PrincipalKind, kind), name)


@dataclass(frozen=True, slots=True)
class CallIdentity:
    """Who made the RPC being handled, and the chain of work it belongs to. ``principal`` is the
    verified caller (None when TLS is off); ``team`` the team it acts for ("" for an operator
    that names none)."""

    team: str
    correlation_id: str | None = None
    causation_id: str | None = None
    principal: Principal | None = None


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
    """The :class:`CallIdentity` of a call without a principal (TLS off): ``kiln-team`` as sent.

    Raises:
        Unauthenticated: no ``kiln-team`` entry.
        InvalidArgument: a malformed team name, conflicting repeated entries, or an over-long
            or unprintable correlation/causation id.
    """
    return identity_for(None, metadata)


def identity_for(
    principal: Principal | None, metadata: Iterable[tuple[str, str | bytes]] | None
) -> CallIdentity:
    """The :class:`CallIdentity` of a call by ``principal`` (None: TLS off) with ``metadata``.

    Raises:
        PermissionDenied: a team principal's ``kiln-team`` names another team.
        Unauthenticated: no ``kiln-team`` where one is needed (a service principal, or no
            principal).
        InvalidArgument: a malformed team name, conflicting repeated entries, or an over-long
            or unprintable correlation/causation id.
    """
    items = [(k, v) for k, v in (metadata or ())]
    sent = _single(items, TEAM_METADATA_KEY)
    if principal is None:
        team = validate_team(sent)
    elif principal.kind == "team":
        team = principal.name
        if sent and sent != team:
            raise PermissionDenied(
                f"principal {principal.uri} may act only for team {team!r}, not for "
                f"{sent[:80]!r} (metadata '{TEAM_METADATA_KEY}'): a team's certificate names "
                "its team"
            )
    elif principal.kind == "service":
        if not sent:
            raise Unauthenticated(
                f"service principal {principal.uri} must name the team it acts for in gRPC "
                f"metadata '{TEAM_METADATA_KEY}'"
            )
        team = validate_team(sent)
    else:  # an operator acts as itself; a team it names scopes its reads
        team = validate_team(sent) if sent else ""
    return CallIdentity(
        team=team,
        correlation_id=_optional_id(items, CORRELATION_METADATA_KEY),
        causation_id=_optional_id(items, CAUSATION_METADATA_KEY),
        principal=principal,
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
