"""The agent runner's ways into the ledger: one client per team (appends record who asked), paged
queries, retries.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from kiln.common.client import team_channel
from kiln.common.errors import Unavailable, from_rpc_error
from kiln.common.logging import get_logger
from kiln.ledger.client import PROJECTIONS, LedgerClient
from kiln.v1 import ledger_pb2, ledger_pb2_grpc

log = get_logger("kiln.agent_runner.ledger")

T = TypeVar("T")


@dataclass(frozen=True)
class Page:
    """One page of projection rows, the next page's token ("" = last) and the projection's
    position.
    """

    rows: list[dict[str, Any]]
    next_page_token: str
    checkpoint_position: int


class LedgerPool:
    """Ledger clients by team, created on first use and closed together; ``system_team`` makes
    the runner's own reads.
    """

    def __init__(self, addr: str, system_team: str) -> None:
        self.addr = addr
        self.system_team = system_team
        self._clients: dict[str, LedgerClient] = {}
        self._query_channel: grpc.aio.Channel | None = None
        self._query_stub: Any = None

    def _queries(self) -> Any:
        """The stub of the runner's queries; its channel is made on first use, so it presents
        the client identity of the service that uses it (kiln.common.client)."""
        if self._query_stub is None:
            self._query_channel = team_channel(self.addr, self.system_team)
            self._query_stub = ledger_pb2_grpc.LedgerStub(self._query_channel)
        return self._query_stub

    def client(self, team: str) -> LedgerClient:
        """The client appending as ``team``; Unauthenticated or InvalidArgument for a bad team."""
        found = self._clients.get(team)
        if found is None:
            found = self._clients[team] = LedgerClient(self.addr, team)
        return found

    @property
    def system(self) -> LedgerClient:
        """The client of the runner's own reads."""
        return self.client(self.system_team)

    async def query_page(
        self,
        projection: str,
        filter: dict[str, str] | None = None,
        *,
        limit: int = 0,
        page_token: str = "",
        timeout_s: float = 30.0,
    ) -> Page:
        """One page of a projection with its token and checkpoint; InvalidArgument for a bad
        query, Unavailable when the ledger cannot be reached.
        """
        request = ledger_pb2.QueryRequest(
            projection=PROJECTIONS[projection],
            filter=filter or {},
            limit=limit,
            page_token=page_token,
        )
        try:
            resp = await self._queries().Query(request, timeout=timeout_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        rows = [json.loads(r) for r in resp.rows_json]
        return Page(rows, resp.next_page_token, resp.checkpoint_position)

    async def query_all(
        self, projection: str, filter: dict[str, str] | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """Every row of a projection matching ``filter`` and the lowest checkpoint seen."""
        rows: list[dict[str, Any]] = []
        token, checkpoint = "", -1
        while True:
            page = await self.query_page(projection, filter, page_token=token)
            rows.extend(page.rows)
            checkpoint = (
                page.checkpoint_position
                if checkpoint < 0
                else min(checkpoint, page.checkpoint_position)
            )
            token = page.next_page_token
            if not token:
                return rows, max(checkpoint, 0)

    async def close(self) -> None:
        """Close every channel."""
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._query_channel is not None:
            await self._query_channel.close(None)
            self._query_channel = self._query_stub = None


async def retry_unavailable(
    call: Callable[[], Awaitable[T]], *, attempts: int = 5, first_wait_s: float = 0.2
) -> T:
    """``await call()``, retried after growing pauses while it raises Unavailable (at most
    ``attempts`` tries); other errors at once.
    """
    wait = first_wait_s
    for attempt in range(1, attempts + 1):
        try:
            return await call()
        except Unavailable as exc:
            if attempt == attempts:
                raise
            log.warning("ledger unavailable; retrying", attempt=attempt, error=exc.message)
            await asyncio.sleep(wait)
            wait = min(wait * 2, 5.0)
    raise AssertionError("unreachable")
