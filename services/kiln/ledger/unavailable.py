"""A database that cannot be reached is UNAVAILABLE, not INTERNAL.

PostgreSQL refusing or dropping connections (down, restarting, shutting down, starting up) is
the deployment's trouble, not the caller's or a bug: clients retry UNAVAILABLE (the engine
pool's delivery and the agent runner wait it out, docs/design/security.md "Recovery"), while
INTERNAL tells them to give up. :func:`database_unavailable` recognises those errors;
:func:`unavailable_on_database_errors` maps them for every method of a servicer.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import psycopg
from sqlalchemy import exc as sa_exc

from kiln.common.errors import Unavailable

T = TypeVar("T")

_DISCONNECTS = (
    psycopg.OperationalError,  # refused, reset, admin/crash shutdown, "starting up" (57P0x)
    psycopg.InterfaceError,  # the connection was closed under us
    ConnectionError,
    TimeoutError,  # connect_timeout, a pool checkout that never got a connection
)


def database_unavailable(exc: BaseException) -> Unavailable | None:
    """An :class:`Unavailable` naming the cause when ``exc`` means the database cannot be
    reached (connection refused or reset, PostgreSQL shutting down or starting up, a
    connection lost mid-query); None for anything else (constraint violations, bad SQL, bugs).
    """
    cause: BaseException | None = exc
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return _unavailable(exc.orig or exc)
        cause = exc.orig
    elif isinstance(exc, sa_exc.TimeoutError):  # the pool's checkout timed out
        return _unavailable(exc)
    if isinstance(cause, _DISCONNECTS) or isinstance(exc, _DISCONNECTS):
        return _unavailable(cause or exc)
    return None


def _unavailable(cause: BaseException) -> Unavailable:
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return Unavailable(f"the ledger's database is unavailable ({first}); retry later")


def _mapped(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            try:
                async for item in method(*args, **kwargs):
                    yield item
            except Exception as exc:
                mapped = database_unavailable(exc)
                if mapped is None:
                    raise
                raise mapped from exc

        return stream

    @functools.wraps(method)
    async def unary(*args: Any, **kwargs: Any) -> Any:
        try:
            return await method(*args, **kwargs)
        except Exception as exc:
            mapped = database_unavailable(exc)
            if mapped is None:
                raise
            raise mapped from exc

    return unary


def unavailable_on_database_errors(cls: type[T]) -> type[T]:
    """Class decorator: every public ``async`` method of the servicer ``cls`` (its RPCs)
    raises :class:`Unavailable` instead of a database-unreachable error."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not (
            inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)
        ):
            continue
        setattr(cls, name, _mapped(member))
    return cls
