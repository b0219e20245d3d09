"""Quoting user-supplied text in error messages, boundedly (stdlib only, so engine-side code that
must not import gRPC can use it too; :mod:`kiln.common.errors` re-exports it).

A hostile caller can send megabytes in any string field; an error that quoted it whole would be
a reply larger than gRPC's 8 KiB metadata limit (the client sees RESOURCE_EXHAUSTED instead of
the real status) and a log line as large.
"""

from __future__ import annotations

MAX_QUOTE_CHARS = 200
"""Characters of a user-supplied value an error message quotes (:func:`quote`)."""
MAX_MESSAGE_CHARS = 2000
"""Longest error message (:func:`bounded`): room for a few quotes and a list of known names,
well inside gRPC's default 8 KiB metadata limit."""


def quote(value: object, limit: int = MAX_QUOTE_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the value's length
    noted (e.g. ``'xxxx…' (1048576 characters)``)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str | bytes) else ""
    return f"{text[:limit]}…{size}"


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to at most ``limit`` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    tail = f"… [{len(message)} characters, cut]"
    return message[: limit - len(tail)] + tail
