"""What a trace reader yields: one :class:`Request` per row, and the :class:`Trace` around them.

Stdlib only, so the records import anywhere (engines, the cost model, tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a serving trace.

    Attributes:
        arrival_s: arrival time, seconds after the trace's earliest arrival (so the first
            request arrives at 0.0).
        isl: input sequence length (prompt tokens).
        osl: output sequence length (generated tokens).
        hash_ids: ids of the prompt's prefix blocks in order (Mooncake: 512 tokens a block;
            equal ids mean the same reusable KV block). Empty when the trace has none (Azure).
    """

    arrival_s: float
    isl: int
    osl: int
    hash_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival_s):
            raise ValueError(f"arrival_s must be finite, got {self.arrival_s}")
        if self.isl < 0 or self.osl < 0:
            raise ValueError(f"token counts must be >= 0, got isl={self.isl} osl={self.osl}")


class RowProblem(NamedTuple):
    """A malformed row: its 1-based physical line number in the file and why it was rejected."""

    line: int
    reason: str


@dataclass(frozen=True)
class Trace:
    """The requests read from one trace file, in arrival order.

    Attributes:
        path: the file read.
        format: ``"azure_csv"``, ``"mooncake_jsonl"``, ``"servegen_requests_jsonl"`` or
            ``"servegen_client"`` (requests drawn from a ServeGen client's distributions).
        requests: the well-formed rows, sorted by arrival (stable, so ties keep file order).
        problems: malformed rows that were skipped (fewer than the reader's threshold), and for
            ``servegen_client`` the windows whose drawn requests were dropped.
        reordered: rows whose arrival was earlier than the previous row's; the reader sorted
            them into place rather than rejecting them.
        zero_output: requests kept with 0 output tokens (prefill-only).
    """

    path: Path
    format: str
    requests: tuple[Request, ...]
    problems: tuple[RowProblem, ...] = ()
    reordered: int = 0
    zero_output: int = 0
