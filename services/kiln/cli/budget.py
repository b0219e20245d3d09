"""Parsing budgets given on the command line ("5m", "90s", "1h30m", "300")."""

from __future__ import annotations

import math
import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration_s(text: str) -> float:
    """Seconds in ``text``: a number of seconds ("300", "2.5") or units h/m/s ("1h30m", "90s").

    Raises:
        ValueError: empty, malformed, not finite, or not positive (the message quotes the text).
    """
    raw = text.strip().lower()
    try:
        seconds = float(raw)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _PART.finditer(raw):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNIT_S[match.group(2)]
            pos = match.end()
        if not raw or pos != len(raw):
            raise ValueError(
                f"budget {text!r} is not a duration: use seconds or h/m/s, e.g. 300, 5m, 1h30m"
            ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"budget {text!r} must be a positive duration")
    return seconds
