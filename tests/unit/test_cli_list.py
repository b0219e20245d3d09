"""``kiln compilations list`` shows a page in order of creation, whatever the ids' order.

The agent runner's List is replaced by a canned page here (its paging by id is tested over real
gRPC in tests/integration/test_compiler_grpc.py); this checks only the CLI's display."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from kiln.cli import compilations
from kiln.cli.main import app
from kiln.v1 import compiler_pb2


def _compilation(cid: str, created: datetime) -> compiler_pb2.Compilation:
    c = compiler_pb2.Compilation(compilation_id=cid, team="search")
    c.created_at.FromDatetime(created)
    return c


def test_list_shows_the_page_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    page = compiler_pb2.ListResponse(
        compilations=[
            _compilation("aaaa", datetime(2026, 11, 30, 12, 0, tzinfo=UTC)),
            _compilation("bbbb", datetime(2026, 11, 30, 10, 0, tzinfo=UTC)),
            _compilation("cccc", datetime(2026, 11, 30, 11, 0, tzinfo=UTC)),
        ]
    )

    async def canned(ctx: object, method: str, request: object) -> object:
        assert method == "List"
        return page

    monkeypatch.setattr(compilations, "_call", canned)
    result = CliRunner().invoke(app, ["compilations", "list"])
    assert result.exit_code == 0, result.output
    words = [line.split()[0] for line in result.output.splitlines() if line.strip()]
    ids = [w for w in words if w in ("aaaa", "bbbb", "cccc")]
    assert ids == ["bbbb", "cccc", "aaaa"]
