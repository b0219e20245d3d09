"""Reading the projections: equality filters on columns, keyset pagination in listing order:
oldest first by the projection's creation time (``Projection.created``), ties by primary key;
by primary key for projections without one (best candidates per workload key)."""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, DateTime, Float, Integer, Table, select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine

from kiln.common.errors import InvalidArgument, quote
from kiln.ledger.bounds import (
    MAX_PAGE_TOKEN_CHARS,
    check_bigint,
    check_finite,
    check_text,
)
from kiln.ledger.projections import all_projections
from kiln.ledger.projections.checkpoint import read_checkpoint
from kiln.ledger.tables import proj_compilations

MAX_LIMIT = 10_000


def projection_names() -> list[str]:
    """Names accepted by :func:`query` ("compilations", "experiments", "best_candidates")."""
    return [p.name for p in all_projections()]


def _cast(table: Table, column: str, value: str) -> Any:
    """``value`` as ``column``'s type: InvalidArgument when malformed, longer than
    ``MAX_FILTER_CHARS``, with a NUL or not finite; OutOfRange beyond ``bigint``."""
    col = table.c[column]
    check_text(f"filter {column}", value)
    try:
        if isinstance(col.type, Boolean):
            if value.lower() not in ("true", "false"):
                raise ValueError(value)
            return value.lower() == "true"
        if isinstance(col.type, (Integer, BigInteger)):
            return check_bigint(f"filter {column}", int(value))
        if isinstance(col.type, Float):
            return check_finite(f"filter {column}", float(value))
        if isinstance(col.type, DateTime):
            parsed = datetime.fromisoformat(value)
            if parsed.tzinfo is None:
                raise ValueError(value)
            return parsed
    except ValueError:
        kind = (
            "ISO 8601 time with a UTC offset"
            if isinstance(col.type, DateTime)
            else col.type.python_type.__name__
        )
        raise InvalidArgument(f"filter {column}={quote(value)}: not a valid {kind}") from None
    return value


def _query_id(projection: str, filters: dict[str, str]) -> str:
    """Identifies a query, so a page token is only accepted for the query that made it."""
    text = json.dumps([projection, sorted(filters.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _encode_token(after: list[str], query_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": after, "q": query_id}).encode()).decode()


def _decode_token(token: str, query_id: str, width: int) -> list[str]:
    """The last row's listing key (``width`` strings) of the page that made ``token``."""
    check_text("page_token", token, MAX_PAGE_TOKEN_CHARS)
    try:
        obj = json.loads(base64.urlsafe_b64decode(token.encode()))
        after, token_query = obj["after"], obj["q"]
        if not isinstance(after, list) or len(after) != width:
            raise TypeError(after)
        after = [str(a) for a in after]
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument(f"malformed page_token {quote(token)}") from None
    if token_query != query_id:
        raise InvalidArgument("page_token belongs to another query (projection or filter differ)")
    return after


def _of_team(table: Table, team: str) -> Any:
    """The condition "row of ``team``'s compilations": the compilations projection's own team
    column, the others' compilation id among that team's compilations."""
    if "team" in table.c:
        return table.c.team == team
    return table.c.compilation_id.in_(
        select(proj_compilations.c.compilation_id).where(proj_compilations.c.team == team)
    )


async def query(
    engine: AsyncEngine,
    projection: str,
    filters: dict[str, str],
    *,
    limit: int = 1000,
    page_token: str = "",
    team: str | None = None,
) -> tuple[list[dict[str, Any]], str, int]:
    """Rows of one projection, oldest first (see the module docs).

    Args:
        projection: a name from :func:`projection_names`.
        filters: column -> value (compared for equality, cast to the column's type).
        limit: rows per page (1..10000).
        page_token: from the previous page ("" = first page).
        team: only rows of this team's compilations (the caller's read scope,
            kiln.common.policy); None = every team's.

    Returns:
        (rows, next page token or "", the projection checkpoint position the rows reflect).

    Raises:
        InvalidArgument: unknown projection or column, a value of the wrong type, too long, with
            a NUL or not finite (:func:`_cast`), a bad token.
        OutOfRange: an integer value beyond PostgreSQL ``bigint``.
    """
    by_name = {p.name: p for p in all_projections()}
    proj = by_name.get(projection)
    if proj is None:
        raise InvalidArgument(
            f"unknown projection {quote(projection)}; known: {', '.join(sorted(by_name))}"
        )
    table, key = proj.table, proj.key
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"limit must be within 1..{MAX_LIMIT}, got {limit}")
    stmt = select(table)
    for column, value in filters.items():
        if column not in table.c:
            raise InvalidArgument(
                f"{projection} has no column {quote(column)}; columns: {', '.join(table.c.keys())}"
            )
        stmt = stmt.where(table.c[column] == _cast(table, column, value))
    if team is not None:
        stmt = stmt.where(_of_team(table, team))
    query_id = _query_id(projection, filters)
    order = [proj.created, key] if proj.created else [key]
    columns = [table.c[c] for c in order]
    if page_token:
        after = _decode_token(page_token, query_id, len(order))
        values = [_cast(table, c, v) for c, v in zip(order, after, strict=True)]
        stmt = stmt.where(tuple_(*columns) > tuple_(*values))
    stmt = stmt.order_by(*columns).limit(limit + 1)
    async with engine.connect() as conn:
        checkpoint = await read_checkpoint(conn)
        rows = [dict(r._mapping) for r in await conn.execute(stmt)]
    next_token = ""
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1]
        next_token = _encode_token(
            [
                v.isoformat() if isinstance(v, datetime) else str(v)
                for v in (last[c] for c in order)
            ],
            query_id,
        )
    return rows, next_token, checkpoint
