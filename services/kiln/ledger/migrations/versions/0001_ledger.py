"""The ledger: events, outbox, projection checkpoints and the first three projections.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

from kiln.ledger import tables

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_TABLES = [
    tables.events,
    tables.outbox,
    tables.projection_checkpoints,
    tables.projection_failures,
    tables.proj_compilations,
    tables.proj_experiments,
    tables.proj_best_candidates,
]


def upgrade() -> None:
    bind = op.get_bind()
    for table in _TABLES:
        table.create(bind)
    op.create_index("ix_events_type", "events", ["type"])
    # The ledger is append-only: refuse UPDATE and DELETE of events outright.
    op.execute(
        """
        CREATE FUNCTION kiln_events_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'kiln ledger events are append-only (% refused)', TG_OP
                USING ERRCODE = 'restrict_violation';
        END $$;
        """
    )
    op.execute(
        """
        CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
        FOR EACH ROW EXECUTE FUNCTION kiln_events_append_only();
        """
    )
    op.execute(
        "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
        "FOR EACH STATEMENT EXECUTE FUNCTION kiln_events_append_only();"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS events_no_truncate ON events")
    op.execute("DROP TRIGGER IF EXISTS events_append_only ON events")
    op.execute("DROP FUNCTION IF EXISTS kiln_events_append_only()")
    for table in reversed(_TABLES):
        table.drop(op.get_bind())
