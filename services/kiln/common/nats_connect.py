"""Connecting to NATS: retries, reconnects, and a user's credentials and inbox."""

from __future__ import annotations

from typing import Any

import nats
import structlog
from nats.aio.client import Client
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from kiln.common.errors import Unauthenticated, Unavailable

log = structlog.get_logger(__name__)

_CONNECT_ERRORS = (OSError, TimeoutError, nats.errors.Error)


NatsCredentials = tuple[str, str]
"""(user, password) of a NATS user (:meth:`kiln.common.settings.KilnSettings.nats_credentials`)."""


def inbox_prefix(user: str | None) -> str:
    """The reply-subject prefix of a connection: ``_INBOX.<user>`` for a user (its permissions
    let it subscribe there only, so no identity reads another's replies), else ``_INBOX``."""
    return "_INBOX" if user is None else f"_INBOX.{user}"


def _refused(exc: BaseException) -> bool:
    """True when the server refused the connection's credentials (or the lack of them)."""
    return isinstance(exc, nats.errors.AuthorizationError) or "Authorization Violation" in str(exc)


async def connect(
    url: str,
    name: str,
    *,
    credentials: NatsCredentials | None = None,
    attempts: int = 5,
    connect_timeout_s: float = 2.0,
    reconnect_wait_s: float = 1.0,
) -> Client:
    """Connect to NATS, retrying the initial connection, then reconnecting forever.

    Args:
        url: server URL(s), comma-separated.
        credentials: (user, password), or None for a server without users (CI's NATS).
        attempts: initial-connect attempts before giving up.
        connect_timeout_s, reconnect_wait_s: per-try timeout and pause between tries, seconds.

    Raises:
        Unauthenticated: the server refused the credentials, or requires some (not retried).
        Unavailable: no server answered within ``attempts`` attempts.
    """
    servers = [s.strip() for s in url.split(",") if s.strip()]
    user, password = credentials if credentials is not None else (None, None)
    auth: dict[str, Any] = {"inbox_prefix": inbox_prefix(user)}
    if user is not None:
        auth.update(user=user, password=password)

    refused: list[BaseException] = []  # nats-py reports a refusal here, then "no servers"

    async def _error_cb(exc: Exception) -> None:
        if _refused(exc):
            refused.append(exc)
        log.warning("nats.error", client=name, error=str(exc) or type(exc).__name__)

    async def _disconnected_cb() -> None:
        log.info("nats.disconnected", client=name)

    async def _reconnected_cb() -> None:
        log.info("nats.reconnected", client=name)

    last: BaseException | None = None
    try:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(max(1, attempts)),
            wait=wait_exponential(multiplier=0.25, max=4.0),
            retry=retry_if_exception(
                lambda e: isinstance(e, _CONNECT_ERRORS) and not (refused or _refused(e))
            ),
            reraise=True,
        ):
            with attempt:
                # nats-py quirk: with max_reconnect_attempts <= 0 the *initial* connect loops
                # forever, so bound it here and lift the bound once connected.
                nc = await nats.connect(
                    servers,
                    name=name,
                    allow_reconnect=True,
                    max_reconnect_attempts=1,
                    connect_timeout=connect_timeout_s,
                    reconnect_time_wait=reconnect_wait_s,
                    error_cb=_error_cb,
                    disconnected_cb=_disconnected_cb,
                    reconnected_cb=_reconnected_cb,
                    **auth,
                )
                nc.options["max_reconnect_attempts"] = -1
                return nc
    except _CONNECT_ERRORS as exc:
        if refused or _refused(exc):
            who = f"user {user!r}" if user is not None else "a connection without credentials"
            why = f"NATS at {url} refused {who} (Authorization Violation)"
            raise Unauthenticated(why) from None
        last = exc
    raise Unavailable(f"cannot reach NATS at {url} after {attempts} attempts: {last!r}")
