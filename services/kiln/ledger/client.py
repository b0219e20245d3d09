"""Async client of the Ledger service, used by the other services and the CLI.

Every call carries the team identity; failures arrive as ``kiln.common.errors.KilnError``
subclasses (``NotFound``, ``Aborted``, ``InvalidArgument``, ``Unavailable`` ...).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import grpc

from kiln.common.client import team_channel
from kiln.common.errors import InvalidArgument, from_rpc_error
from kiln.common.tls import TlsMaterial
from kiln.ledger import convert
from kiln.ledger.model import AppendResult, ExpectedVersion, NewEvent
from kiln.v1 import ledger_pb2, ledger_pb2_grpc

PROJECTIONS = {
    "compilations": ledger_pb2.PROJECTION_COMPILATIONS,
    "experiments": ledger_pb2.PROJECTION_EXPERIMENTS,
    "best_candidates": ledger_pb2.PROJECTION_BEST_CANDIDATES,
    "best-candidates": ledger_pb2.PROJECTION_BEST_CANDIDATES,
}


class LedgerClient:
    """Ledger calls over one channel.

    Args:
        addr: ``host:port`` of a ledger service.
        team: team identity sent as ``kiln-team`` metadata.
        timeout_s: deadline of unary calls, seconds (streams have none).
        tls: the certificate to present (default: the context's client identity,
            :func:`kiln.common.client.channel`).
    """

    def __init__(
        self,
        addr: str,
        team: str,
        *,
        timeout_s: float = 30.0,
        tls: TlsMaterial | Literal["current"] | None = "current",
    ) -> None:
        self.addr = addr
        self._channel = team_channel(addr, team, tls=tls)
        self._stub = ledger_pb2_grpc.LedgerStub(self._channel)
        self._timeout = timeout_s

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close(None)

    async def append(
        self, stream_id: str, events: Sequence[NewEvent], expected: ExpectedVersion = "any"
    ) -> AppendResult:
        """Append events to one stream (see ``Ledger.Append``)."""
        request = ledger_pb2.AppendRequest(
            stream_id=stream_id,
            expected_version=convert.expected_to_proto(expected),
            events=[convert.event_to_proto_data(e) for e in events],
        )
        try:
            resp = await self._stub.Append(request, timeout=self._timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return AppendResult(list(resp.positions), resp.stream_version, resp.already_stored)

    async def read_stream(
        self, stream_id: str, from_version: int = 1, max_count: int = 0
    ) -> list[ledger_pb2.RecordedEvent]:
        """Every event of a stream from ``from_version`` (pages through ``max_count`` = 0)."""
        out: list[ledger_pb2.RecordedEvent] = []
        version = max(from_version, 1)
        while True:
            request = ledger_pb2.ReadStreamRequest(
                stream_id=stream_id, from_version=version, max_count=max_count
            )
            try:
                resp = await self._stub.ReadStream(request, timeout=self._timeout)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
            out.extend(resp.events)
            if max_count or resp.end_of_stream or not resp.events:
                return out
            version = resp.events[-1].stream_version + 1

    async def read_all(
        self,
        after_position: int = 0,
        follow: bool = False,
        types: Sequence[str] = (),
        stream_prefix: str = "",
        max_count: int = 0,
    ) -> AsyncIterator[ledger_pb2.RecordedEvent]:
        """Events in global order after ``after_position``; with ``follow``, forever."""
        request = ledger_pb2.ReadAllRequest(
            after_position=after_position,
            follow=follow,
            types=list(types),
            stream_prefix=stream_prefix,
            max_count=max_count,
        )
        call = self._stub.ReadAll(request)
        try:
            async for event in call:
                yield event
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def query(
        self, projection: str, filter: dict[str, str] | None = None, limit: int = 0
    ) -> list[dict[str, Any]]:
        """Rows of a projection; ``limit`` 0 reads every page."""
        if projection not in PROJECTIONS:
            raise InvalidArgument(
                f"unknown projection {projection!r}; known: compilations, experiments, "
                "best-candidates"
            )
        rows: list[dict[str, Any]] = []
        token = ""
        while True:
            request = ledger_pb2.QueryRequest(
                projection=PROJECTIONS[projection],
                filter=filter or {},
                limit=limit,
                page_token=token,
            )
            try:
                resp = await self._stub.Query(request, timeout=self._timeout)
            except grpc.RpcError as err:
                raise from_rpc_error(err) from None
            rows.extend(json.loads(r) for r in resp.rows_json)
            token = resp.next_page_token
            if limit or not token:
                return rows

    async def replay(
        self, apply: bool = False, projections: Sequence[str] = ()
    ) -> ledger_pb2.ReplayResponse:
        """Rebuild projections and compare with the live ones (see ``Ledger.Replay``)."""
        request = ledger_pb2.ReplayRequest(
            apply=apply, projections=[PROJECTIONS[p] for p in projections]
        )
        try:
            return await self._stub.Replay(request, timeout=max(self._timeout, 600.0))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
