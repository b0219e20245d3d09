"""Open-ended server streams per caller: a cap, so one caller's idle follows cannot slow the
other teams' reads (docs/design/security.md, "Quotas and fairness").

A *follow* (``Ledger.ReadAll`` with ``follow``, ``Compiler.Watch``) holds a task and wakes on
every commit until the client goes away. :class:`StreamLimiter` counts the open follows of each
caller — a team, an operator, or with TLS off the self-declared team — and refuses one beyond
``limit`` with RESOURCE_EXHAUSTED. Service principals are not counted: a service multiplexes its
own clients' streams (the agent runner opens one ledger follow per Compiler.Watch, each already
counted against the watching team).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kiln.common.errors import ResourceExhausted
from kiln.common.identity import CallIdentity


def caller_key(call: CallIdentity) -> str | None:
    """The key a caller's follows are counted under; None for a service (not counted)."""
    principal = call.principal
    if principal is None:
        return f"team:{call.team}"
    if principal.kind == "service":
        return None
    return principal.uri


class StreamLimiter:
    """At most ``limit`` open streams per caller (``limit`` >= 1); ``what`` names them in the
    refusal. Not thread-safe: use it from one event loop (the gRPC aio server's)."""

    def __init__(self, limit: int, what: str) -> None:
        if limit < 1:
            raise ValueError(f"a stream limit must be at least 1, got {limit}")
        self.limit = limit
        self.what = what
        self._open: dict[str, int] = {}

    def open_count(self, key: str) -> int:
        """The streams ``key`` holds now."""
        return self._open.get(key, 0)

    @contextmanager
    def hold(self, call: CallIdentity) -> Iterator[None]:
        """Count one stream of ``call``'s caller while the block runs.

        Raises:
            ResourceExhausted: the caller already holds ``limit`` streams (the message says how
                many and what to do).
        """
        key = caller_key(call)
        if key is None:
            yield
            return
        held = self._open.get(key, 0)
        if held >= self.limit:
            raise ResourceExhausted(
                f"{key} already holds {held} open {self.what} (the limit per caller); close one "
                "or read without following"
            )
        self._open[key] = held + 1
        try:
            yield
        finally:
            left = self._open[key] - 1
            if left:
                self._open[key] = left
            else:
                del self._open[key]
