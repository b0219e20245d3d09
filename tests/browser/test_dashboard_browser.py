"""The dashboard in a real headless chromium: pages load from ``kiln dashboard`` (a child
process acting for a team) over the pool stack's real services; the script runs; the plot and
tables are in the DOM; a filter hides rows; a running compilation's page updates itself until it
ends; untrusted board text never runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from kiln.board import Board
from kiln.common import nats as kn
from kiln.common.settings import KilnSettings

from ..integration.pool_stack import PoolStack
from .cdp import Browser
from .dashboard_stack import (
    MODEL,
    DashboardProcess,
    dashboard,
    dashboard_stack,
    submit,
    wait_ended,
)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.integration,
    pytest.mark.skipif(not MODEL.is_file(), reason="../shared/data is absent"),
]

TEAM = "dash-browser"
WALL_S = 8.0
"""Budget of each compilation: enough for the baseline and a confirmation on a loaded CI."""
HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[PoolStack]:
    async with dashboard_stack(settings, "kb") as s:
        yield s


@pytest_asyncio.fixture(scope="module")
async def served(
    stack: PoolStack, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[DashboardProcess]:
    async with dashboard(stack, TEAM, tmp_path_factory.mktemp("dash")) as dash:
        yield dash


@pytest_asyncio.fixture(scope="module")
async def ended(stack: PoolStack) -> str:
    cid = await submit(stack, TEAM, 13, WALL_S)
    await wait_ended(stack, TEAM, cid)
    nc = await kn.connect(stack.settings.require_nats_url(), "test-dashboard-browser")
    try:
        await Board(nc.jetstream(), stack.settings.subject_prefix).post_idea(
            cid, "hostile-1", "intruder", {"why": HOSTILE}
        )
    finally:
        await nc.close()
    return cid


async def _js(browser: Browser, session: str, expr: str) -> Any:
    return await asyncio.to_thread(browser.eval, session, expr)


async def _until(browser: Browser, session: str, expr: str, timeout_s: float = 30) -> Any:
    return await asyncio.to_thread(browser.wait_for, session, expr, timeout_s)


async def _open(browser: Browser, url: str) -> str:
    session = await asyncio.to_thread(browser.open, url)
    await _until(browser, session, "document.body && document.body.dataset.js === 'ready'")
    return session


async def test_compilation_page_has_plot_tables_and_a_working_filter(
    browser: Browser, served: DashboardProcess, ended: str
) -> None:
    session = await _open(browser, f"{served.url}compilations/{ended}")
    facts = await _js(
        browser,
        session,
        """JSON.stringify({
          svg: document.querySelectorAll('#plot svg.plot').length,
          points: document.querySelectorAll('#plot svg circle.point').length,
          series: Array.from(document.querySelectorAll('#plot g.series'))
                      .map(g => g.dataset.series),
          rows: document.querySelectorAll('#experiments tr.exp').length,
          baselines: document.querySelectorAll('#baselines tr.baseline').length,
          board: document.querySelectorAll('#board tr.post').length,
          status: document.getElementById('status').textContent,
          count: document.getElementById('exp-count').textContent,
          pwned: window.pwned === undefined ? null : window.pwned,
        })""",
    )
    got = json.loads(facts)
    assert got["svg"] == 1 and got["points"] >= 1
    assert "coordinate (fast)" in got["series"]
    assert got["rows"] >= 2 and got["baselines"] >= 1 and got["board"] >= 1
    assert got["status"] == "succeeded"
    assert got["count"] == f"{got['rows']} of {got['rows']} shown"
    assert got["pwned"] is None  # the hostile post was shown as text, never run
    text = await _js(browser, session, "document.getElementById('board').textContent")
    assert "window.pwned=2" in text

    filtered = json.loads(
        await _js(
            browser,
            session,
            """(() => {
              const sel = document.getElementById('f-tier');
              sel.value = 'full';
              sel.dispatchEvent(new Event('change'));
              const rows = Array.from(document.querySelectorAll('#experiments tr.exp'));
              return JSON.stringify({
                visible: rows.filter(r => !r.hidden).map(r => r.dataset.tier),
                hidden: rows.filter(r => r.hidden).map(r => r.dataset.tier),
                count: document.getElementById('exp-count').textContent,
              });
            })()""",
        )
    )
    assert filtered["visible"] and set(filtered["visible"]) == {"full"}
    assert filtered["hidden"] and "full" not in filtered["hidden"]
    assert filtered["count"].startswith(f"{len(filtered['visible'])} of ")

    agent = json.loads(
        await _js(
            browser,
            session,
            """(() => {
              document.getElementById('f-tier').value = '';
              const sel = document.getElementById('f-agent');
              sel.value = 'nobody-such';
              sel.dispatchEvent(new Event('change'));
              return JSON.stringify(Array.from(
                document.querySelectorAll('#experiments tr.exp')).filter(r => !r.hidden).length);
            })()""",
        )
    )
    assert agent == len(filtered["visible"]) + len(filtered["hidden"])  # unknown value: "any"


async def test_a_running_compilation_updates_itself_until_it_ends(
    browser: Browser, served: DashboardProcess, stack: PoolStack
) -> None:
    cid = await submit(stack, TEAM, 14, WALL_S)
    session = await _open(browser, f"{served.url}compilations/{cid}")
    live = await _js(browser, session, "document.body.dataset.live || ''")
    assert live == f"/api/compilations/{cid}"
    assert await _js(browser, session, "document.body.dataset.status") in ("pending", "running")
    await wait_ended(stack, TEAM, cid)
    final = await _until(
        browser,
        session,
        "['succeeded', 'failed', 'cancelled'].includes(document.body.dataset.status)"
        " && document.body.dataset.status",
    )
    assert final == "succeeded"
    polls = await _js(browser, session, "Number(document.body.dataset.polls || 0)")
    assert polls >= 1
    points = await _js(browser, session, "document.querySelectorAll('#plot circle.point').length")
    assert points >= 1
    status = await _js(browser, session, "document.getElementById('status').textContent")
    assert status == "succeeded"


async def test_compilations_list_links_each_compilation(
    browser: Browser, served: DashboardProcess, ended: str
) -> None:
    session = await _open(browser, served.url)
    links = await _js(
        browser,
        session,
        "Array.from(document.querySelectorAll('#compilations a')).map(a => a.textContent)",
    )
    assert ended in links
