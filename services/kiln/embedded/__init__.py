"""The embedded default: real NATS and PostgreSQL servers, shipped as Python wheels, run under
a state directory so that ``kiln up`` works on a machine that has neither.

- :mod:`kiln.embedded.postgres`: :class:`~kiln.embedded.postgres.EmbeddedPostgres`
- :mod:`kiln.embedded.nats`: :class:`~kiln.embedded.nats.EmbeddedNats`
- :mod:`kiln.embedded.supervisor`: what ``kiln up`` / ``kiln down`` / ``kiln status`` do
"""
