"""Ranges of the ledger's request arguments: positions and versions, read sizes, filter text.

Checked before anything reaches PostgreSQL, whose own refusals (``bigint out of range``, ``text
fields cannot contain NUL``, ``number of parameters must be between 0 and 65535``) would surface
as INTERNAL. A value out of range is :class:`~kiln.common.errors.OutOfRange`; malformed text is
:class:`~kiln.common.errors.InvalidArgument`; both name the field and quote the value briefly.
"""

from __future__ import annotations

import math

from kiln.common.errors import InvalidArgument, OutOfRange, quote
from kiln.common.identity import MAX_ID_CHARS

MAX_POSITION = 2**63 - 1
"""Largest position or stream version: PostgreSQL ``bigint`` (the ``events`` columns)."""
MIN_BIGINT = -(2**63)
MAX_READ_COUNT = 10_000
"""Most events one ReadStream page returns (larger ``max_count`` is lowered; end_of_stream says
whether more remain); the same ceiling as Query's ``limit``."""
MAX_STREAM_ID_CHARS = 1 + 32 + 128
"""``<category>-<id>``: category <= 32, id <= 128 characters (kiln.events.registry)."""
MAX_FILTER_CHARS = 1024
"""Longest filter value or column name: ids are <= 128 characters, times ~32; 1024 is generous."""
MAX_PAGE_TOKEN_CHARS = 4096
"""Longest page token: the ledger's own are a base64 JSON of a few keys (~200 characters)."""


def check_position(field: str, value: int) -> int:
    """``value`` if it fits a position or version (0..2^63-1); OutOfRange otherwise."""
    if not 0 <= value <= MAX_POSITION:
        raise OutOfRange(f"{field} {value} is out of range: positions and versions are 0..2^63-1")
    return value


def check_bigint(field: str, value: int) -> int:
    """``value`` if it fits PostgreSQL ``bigint``; OutOfRange otherwise."""
    if not MIN_BIGINT <= value <= MAX_POSITION:
        raise OutOfRange(f"{field} {value} is out of range: -2^63..2^63-1")
    return value


def check_finite(field: str, value: float) -> float:
    """``value`` if finite; InvalidArgument for NaN or an infinity (e.g. ``1e400``)."""
    if not math.isfinite(value):
        raise InvalidArgument(f"{field} must be a finite number, got {value!r}")
    return value


def check_text(field: str, value: str, max_chars: int = MAX_FILTER_CHARS) -> str:
    """``value`` if it is at most ``max_chars`` characters with no NUL (PostgreSQL text cannot
    hold one); InvalidArgument otherwise."""
    if len(value) > max_chars:
        raise InvalidArgument(
            f"{field} is {len(value)} characters; the limit is {max_chars}: {quote(value)}"
        )
    if "\x00" in value:
        raise InvalidArgument(f"{field} contains a NUL character: {quote(value)}")
    return value


def check_optional_id(field: str, value: str) -> str:
    """A correlation or causation id: "" or printable text of at most ``MAX_ID_CHARS``
    characters (the rule of the ``kiln-correlation-id`` metadata); InvalidArgument otherwise."""
    if value and (len(value) > MAX_ID_CHARS or not value.isprintable()):
        raise InvalidArgument(
            f"{field} must be printable text of at most {MAX_ID_CHARS} characters, got "
            f"{quote(value)}"
        )
    return value


def read_count(max_count: int, default: int) -> int:
    """The page size of a ReadStream: ``max_count`` (0: ``default``) lowered to
    ``MAX_READ_COUNT``."""
    return min(max_count or default, MAX_READ_COUNT)
