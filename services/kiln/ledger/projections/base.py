"""A projection is a pure fold of events into rows keyed by one column.

The same fold drives the live projector (rows loaded from and upserted to PostgreSQL, with the
checkpoint in the same transaction) and replay (rows folded in memory from position 0), so
"rebuild equals live" checks the projector's bookkeeping, not two copies of the logic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from sqlalchemy import Table

from kiln.ledger.model import StoredEvent

FOLD_ERRORS: tuple[type[Exception], ...] = (KeyError, TypeError, ValueError, ArithmeticError)
"""What a fold raises on an event it cannot make sense of (e.g. an older schema): the live
projector quarantines such an event and replay skips it, so both stay comparable."""

Row = dict[str, Any]
Rows = dict[str, Row]


class Projection(ABC):
    """One projection table: ``name``, its live ``table``, primary ``key`` column, the event
    types it reads (``handles``) and ``created``: the column rows are listed by (a time set
    when the row is made and never changed; None: by ``key`` alone)."""

    name: ClassVar[str]
    key: ClassVar[str]
    handles: ClassVar[frozenset[str]]
    created: ClassVar[str | None] = None

    def __init__(self, table: Table) -> None:
        self.table = table

    @abstractmethod
    def key_of(self, event: StoredEvent) -> str | None:
        """The row key ``event`` touches (None: none)."""

    @abstractmethod
    def apply(self, rows: Rows, event: StoredEvent) -> None:
        """Fold ``event`` into ``rows`` (mutate or insert the row at ``key_of(event)``).

        Must be deterministic in the event alone (use ``event.recorded_at``, never the clock).
        ``rows`` holds the current row for the key if one exists.
        """
