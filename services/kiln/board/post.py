"""A message on the board: an idea or a claim about one candidate of one compilation."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kiln.common.nats import BoardKind


def _now() -> datetime:
    return datetime.now(UTC)


class BoardPost(BaseModel):
    """One board post, sent as compact JSON (without ``seq``).

    Attributes:
        kind: ``idea`` (a proposed candidate) or ``claim`` (an agent takes the candidate; at
            most one claim per candidate is ever stored).
        compilation_id, candidate_id: ids of ``[A-Za-z0-9_-]`` (they are subject tokens).
        agent: who posted.
        body: free-form JSON object (recipe, why, notes).
        posted_at: when the poster sent it (UTC, the poster's clock).
        seq: the board stream's sequence once stored (0 before); orders posts and resumes
            :meth:`kiln.board.Board.follow`.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    kind: BoardKind
    compilation_id: str
    candidate_id: str
    agent: str
    body: dict[str, Any] = Field(default_factory=dict)
    posted_at: datetime = Field(default_factory=_now)
    seq: int = 0

    def to_json(self) -> bytes:
        """The wire form: compact UTF-8 JSON without ``seq``."""
        return self.model_dump_json(exclude={"seq"}).encode()
