"""The ledger's tables (SQLAlchemy Core). The schema itself is created by Alembic
(``kiln/ledger/migrations/``).

events        append-only; ``position`` is the global order, assigned under an advisory lock held
              to commit so positions become visible in order (a tailing reader never skips a
              late commit); UNIQUE(stream_id, stream_version) is the optimistic-concurrency check;
              UNIQUE(event_id) makes re-appends idempotent. UPDATE/DELETE are refused by trigger.
outbox        positions committed but not yet acknowledged by JetStream.
projection_checkpoints   last position applied per projection, written in the projection's txn.
projection_failures      events the projector could not fold (quarantined, skipped, reported).
proj_*        the projections (see kiln.ledger.projections).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Integer,
    MetaData,
    Sequence,
    Table,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB, UUID

metadata = MetaData()

events_position_seq = Sequence("events_position_seq", metadata=metadata)

events = Table(
    "events",
    metadata,
    Column("position", BigInteger, events_position_seq, primary_key=True),
    Column("stream_id", Text, nullable=False),
    Column("stream_version", BigInteger, nullable=False),
    Column("event_id", UUID(as_uuid=False), nullable=False, unique=True),
    Column("type", Text, nullable=False),
    Column("schema_version", Integer, nullable=False),
    Column("data", JSONB, nullable=False),
    Column("metadata", JSONB, nullable=False),
    Column("recorded_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    UniqueConstraint("stream_id", "stream_version", name="uq_events_stream_version"),
)

outbox = Table(
    "outbox",
    metadata,
    Column("position", BigInteger, primary_key=True),
)

projection_failures = Table(
    "projection_failures",
    metadata,
    Column("position", BigInteger, primary_key=True),
    Column("event_id", UUID(as_uuid=False), nullable=False),
    Column("type", Text, nullable=False),
    Column("error", Text, nullable=False),
    Column("failed_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)

projection_checkpoints = Table(
    "projection_checkpoints",
    metadata,
    Column("name", Text, primary_key=True),
    Column("position", BigInteger, nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
)


def compilations_table(name: str = "proj_compilations", md: MetaData = metadata) -> Table:
    """One row per compilation: status, counters, baseline and best so far."""
    return Table(
        name,
        md,
        Column("compilation_id", Text, primary_key=True),
        Column("team", Text, nullable=False),
        Column("workload_key", Text, nullable=False),
        Column("model_name", Text, nullable=False),
        Column("hardware", Text, nullable=False),
        Column("status", Text, nullable=False),
        Column("budget_wall_seconds", Float, nullable=False),
        Column("budget_max_experiments", BigInteger, nullable=False),
        Column("experiments_done", BigInteger, nullable=False),
        Column("failures", BigInteger, nullable=False),
        Column("baseline_tokens_per_s", Float),
        Column("best_candidate_id", Text),
        Column("best_tokens_per_s", Float),
        Column("speedup", Float),
        Column("reason", Text, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False),
        Column("updated_at", DateTime(timezone=True), nullable=False),
        Column("last_position", BigInteger, nullable=False),
    )


def experiments_table(name: str = "proj_experiments", md: MetaData = metadata) -> Table:
    """One row per experiment: who proposed what, where it ran, how it did."""
    return Table(
        name,
        md,
        Column("experiment_id", Text, primary_key=True),
        Column("compilation_id", Text, nullable=False, index=True),
        Column("candidate_id", Text, nullable=False),
        Column("agent", Text, nullable=False),
        Column("tier", Text, nullable=False),
        Column("status", Text, nullable=False),
        Column("correct", Boolean),
        Column("median_ms", Float),
        Column("tokens_per_s", Float),
        Column("engine_id", Text),
        Column("error", Text),
        Column("requested_at", DateTime(timezone=True), nullable=False),
        Column("completed_at", DateTime(timezone=True)),
        Column("last_position", BigInteger, nullable=False),
    )


def best_candidates_table(name: str = "proj_best_candidates", md: MetaData = metadata) -> Table:
    """The fastest correct candidate ever found per workload key, across compilations."""
    return Table(
        name,
        md,
        Column("workload_key", Text, primary_key=True),
        Column("candidate_id", Text, nullable=False),
        Column("compilation_id", Text, nullable=False),
        Column("experiment_id", Text, nullable=False),
        Column("tokens_per_s", Float, nullable=False),
        Column("speedup", Float, nullable=False),
        Column("tier", Text, nullable=False),
        Column("found_at", DateTime(timezone=True), nullable=False),
        Column("last_position", BigInteger, nullable=False),
    )


proj_compilations = compilations_table()
proj_experiments = experiments_table()
proj_best_candidates = best_candidates_table()
