"""Where the dashboard's data comes from: kiln's own gRPC APIs, called as the CLI's team
(the process's client identity, :func:`kiln.cli.context.settings_for`), so a page shows only
what that team may read (docs/design/security.md, "Reads").

- compilations: ``Compiler.List`` / ``Compiler.Get`` (Get is also the visibility check: another
  team's id is NOT_FOUND exactly as an unknown one);
- a compilation's baselines: ``Ledger.ReadStream("compilation-<id>")``;
- its experiments (agent, tier, status, phases): ``Ledger.ReadAll`` of the experiment event
  types from the compilation's first position to its ``CompilationEnded`` (or the head, while
  it runs), filtered by ``compilation_id``, read on incrementally (``Compiler.Watch`` carries
  no experiment id, so it is not used);
- deployments: ``Deployments.List``;
- the board: NATS (the board has no gRPC API), read only for a compilation Get showed, and
  only where the NATS user may read the board stream; otherwise a note says why not.

Errors are :class:`kiln.common.errors.KilnError` (NOT_FOUND, UNAVAILABLE, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from typing import Any

import grpc

from kiln.common.client import team_channel
from kiln.common.errors import from_rpc_error
from kiln.common.settings import KilnSettings
from kiln.dashboard.view import EXPERIMENT_TYPES, BoardMessage, CompilationView
from kiln.domain import streams
from kiln.ledger.client import LedgerClient
from kiln.v1 import compiler_pb2, compiler_pb2_grpc, deployments_pb2, deployments_pb2_grpc

MAX_VIEWS = 64
"""Compilations whose folded views are kept between requests (least recently used go)."""

MAX_LISTED = 1000
"""Most compilations a list page shows (the newest)."""

LIST_PAGE, MAX_PAGES = 1000, 50
"""``Compiler.List`` page size, and most pages read for one list page."""

BOARD_TIMEOUT_S = 5.0
"""Longest wait for the board's history of one compilation."""


class Source:
    """Read-only access to one kiln deployment as ``settings.team``; use ``async with``."""

    def __init__(self, settings: KilnSettings, runner_addr: str, ledger_addr: str) -> None:
        self.settings = settings
        self.runner_addr = runner_addr
        self.ledger_addr = ledger_addr
        self._channel: grpc.aio.Channel | None = None
        self._ledger: LedgerClient | None = None
        self._views: OrderedDict[str, tuple[CompilationView, int]] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self._nats: Any = None

    async def __aenter__(self) -> Source:
        self._channel = team_channel(self.runner_addr, self.settings.team)
        self._ledger = LedgerClient(self.ledger_addr, self.settings.team)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._channel is not None:
            await self._channel.close(None)
        if self._ledger is not None:
            await self._ledger.close()
        if self._nats is not None:
            with contextlib.suppress(Exception):
                await self._nats.close()

    @property
    def _compiler(self) -> compiler_pb2_grpc.CompilerStub:
        assert self._channel is not None, "use Source in `async with`"
        return compiler_pb2_grpc.CompilerStub(self._channel)

    async def _unary(self, stub: Any, method: str, request: Any) -> Any:
        try:
            return await getattr(stub, method)(request, timeout=30)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def compilations(self) -> list[compiler_pb2.Compilation]:
        """The team's compilations (summaries), newest first, at most :data:`MAX_LISTED`."""
        out: list[compiler_pb2.Compilation] = []
        token = ""
        for _ in range(MAX_PAGES):  # the server pages oldest first: read on to the newest
            request = compiler_pb2.ListRequest(limit=LIST_PAGE, page_token=token)
            reply = await self._unary(self._compiler, "List", request)
            out.extend(reply.compilations)
            out = out[-MAX_LISTED:]
            token = reply.next_page_token
            if not token:
                break
        return list(reversed(out))

    async def deployments(self) -> list[deployments_pb2.Deployment]:
        """The team's deployments, oldest first."""
        assert self._channel is not None
        stub = deployments_pb2_grpc.DeploymentsStub(self._channel)
        reply = await self._unary(stub, "List", deployments_pb2.ListDeploymentsRequest())
        return list(reply.deployments)

    async def compilation(self, compilation_id: str, *, board: bool = False) -> CompilationView:
        """The compilation now: a fresh Get, then the events recorded since the last call.

        Raises:
            KilnError: NOT_FOUND (unknown or another team's), INVALID_ARGUMENT (malformed id),
                UNAVAILABLE.
        """
        request = compiler_pb2.GetRequest(compilation_id=compilation_id)
        snapshot = await self._unary(self._compiler, "Get", request)
        lock = self._locks.setdefault(compilation_id, asyncio.Lock())
        async with lock:
            view, read_to = self._views.pop(compilation_id, (None, 0))
            if view is None:
                view = CompilationView(snapshot)
            view.snapshot = snapshot
            read_to = await self._read_on(view, read_to)
            self._views[compilation_id] = (view, read_to)
            while len(self._views) > MAX_VIEWS:
                old, _ = self._views.popitem(last=False)
                self._locks.pop(old, None)
        if board:
            await self._read_board(view)
        return view

    async def _read_on(self, view: CompilationView, read_to: int) -> int:
        """Fold the compilation stream and the experiment events after ``read_to``; returns
        the new read position."""
        assert self._ledger is not None
        stream = streams.compilation_stream(view.compilation_id)
        for event in await self._ledger.read_stream(stream):
            view.apply(event)
        start = max(read_to, view.first_position - 1, 0)
        if view.end_position and start >= view.end_position:
            return start  # ended, and read up to its end already
        events = self._ledger.read_all(start, types=EXPERIMENT_TYPES, stream_prefix="experiment-")
        try:
            async for event in events:
                if view.end_position and event.position > view.end_position:
                    return view.end_position  # later events are other compilations'
                view.apply(event)
                start = max(start, event.position)
        finally:
            aclose = getattr(events, "aclose", None)  # an early return ends the call at once
            if aclose is not None:
                await aclose()
        return start

    async def _read_board(self, view: CompilationView) -> None:
        """The board's posts of ``view``'s compilation, or ``board_note`` saying why not."""
        from kiln.board import Board
        from kiln.common.nats import connect

        refused = _board_refused(self.settings)
        if refused:
            view.board_note = refused
            return
        try:
            if self._nats is None:
                url = self.settings.require_nats_url()
                creds = self.settings.nats_credentials()
                self._nats = await connect(url, "kiln-dashboard", credentials=creds, attempts=1)
            board = Board(self._nats.jetstream(), self.settings.subject_prefix)
            async with asyncio.timeout(BOARD_TIMEOUT_S):
                posts = await board.history(view.compilation_id)
        except Exception as exc:  # no NATS, no permission, a timeout: the page still renders
            reason = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            view.board_note = f"the board is not readable here: {reason}"[:300]
            return
        view.board_note = ""
        view.board = [
            BoardMessage(
                seq=p.seq,
                kind=str(p.kind),
                agent=p.agent,
                candidate_id=p.candidate_id,
                posted_at=p.posted_at.isoformat(timespec="seconds"),
                body=json.dumps(p.body, sort_keys=True)[:2000],
            )
            for p in posts
        ]


def _board_refused(settings: KilnSettings) -> str:
    """Why ``settings``' NATS user may not read the board, known without asking the server:
    one of kiln's own users (``kiln up``'s embedded NATS) whose permissions lack the board
    stream's info (the board holds every team's posts: the CLI's user may not read it);
    "" otherwise (an open server, or a user kiln does not define: the server decides)."""
    from kiln.common import nats as kn
    from kiln.embedded.nats_auth import NATS_USERS, permissions

    creds = settings.nats_credentials()
    if creds is None or creds[0] not in NATS_USERS:
        return ""
    info = f"$JS.API.STREAM.INFO.{kn.board_stream_name(settings.subject_prefix)}"
    allowed = permissions(settings.subject_prefix)[creds[0]].publish
    if info in allowed or ">" in allowed:
        return ""
    return (
        f"the board is not shown: the NATS user {creds[0]!r} may not read it (it holds every "
        "team's posts)"
    )
