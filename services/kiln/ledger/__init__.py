"""The results ledger: event store on PostgreSQL, projections, replay, outbox to JetStream."""
