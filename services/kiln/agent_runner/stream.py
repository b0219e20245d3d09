"""Writing a compilation's own stream (``compilation-<id>``) under optimistic concurrency.

The runner is the stream's only writer apart from cancel requests. It appends at the version it
last folded; ``Aborted`` means someone else appended (a cancel request): it re-reads the new
events, folds them, and retries. Event ids are deterministic (:mod:`kiln.agent_runner.records`),
so re-appending an event whose first append committed unseen is an idempotent no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kiln.agent_runner import records
from kiln.agent_runner.outage import ride_out
from kiln.agent_runner.state import CompilationState
from kiln.common.errors import Aborted, KilnError
from kiln.ledger.client import LedgerClient
from kiln.ledger.model import NewEvent

MAX_CONFLICTS = 20


class CompilationStream:
    """Appends to one compilation's stream and keeps ``state`` folded.

    Args:
        state: the compilation's state (its ``version`` is the expected version).
        client: the ledger client of the compilation's team.
        on_cancel: called when a re-read finds a cancel request.
    """

    def __init__(
        self, state: CompilationState, client: LedgerClient, on_cancel: Callable[[], None]
    ) -> None:
        self.state = state
        self._client = client
        self._on_cancel = on_cancel
        self._stream = records.compilation_stream(state.compilation_id)
        self._lock = asyncio.Lock()

    async def append(self, *events: NewEvent) -> None:
        """Append ``events`` (payloads dicts) in one atomic append and fold them.

        Raises:
            KilnError: the ledger refused them or conflicts kept coming (an unavailable ledger
                is waited out).
        """
        st = self.state
        async with self._lock:
            for _ in range(MAX_CONFLICTS):
                try:
                    result = await ride_out(
                        lambda: self._client.append(self._stream, list(events), st.version),
                        what="append to the compilation",
                        compilation=st.compilation_id,
                    )
                except Aborted:
                    await self.sync()
                    continue
                if result.already_stored:
                    await self.sync()
                else:
                    first = result.stream_version - len(events) + 1
                    positions = list(result.positions) + [0] * len(events)
                    for i, event in enumerate(events):
                        assert isinstance(event.data, dict)
                        st.apply_data(event.type, event.data, first + i, positions[i])
                return
        types = ", ".join(e.type for e in events)
        raise KilnError(f"cannot append {types} to {self._stream}: conflicts keep coming")

    async def sync(self) -> None:
        """Fold the stream's events after the state's version."""
        st = self.state
        recorded_events = await ride_out(
            lambda: self._client.read_stream(self._stream, from_version=st.version + 1),
            what="read the compilation",
            compilation=st.compilation_id,
        )
        for recorded in recorded_events:
            st.apply(recorded)
        if st.cancel_reason is not None and not st.ended:
            self._on_cancel()
