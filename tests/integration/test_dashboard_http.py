"""``kiln dashboard`` over HTTP against real services: a short compilation on the pool stack
(real ledger, cost model, engine pool with simulated engines, agent runner; real PostgreSQL and
NATS), the dashboard as a child process acting for the compilation's team, pages fetched with
httpx. Also: another team's compilation is NOT_FOUND (404) to it, untrusted board text is
escaped, a non-loopback listener asks for its token, ``kiln compilations report`` writes one
self-contained file."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from kiln.board import Board
from kiln.common import nats as kn
from kiln.common.settings import KilnSettings
from kiln.dashboard.png import find_browser

from ..browser.dashboard_stack import (
    MODEL,
    cli_env,
    dashboard,
    dashboard_stack,
    submit,
    wait_ended,
)
from .pool_stack import PoolStack
from .serving import run_command

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not MODEL.is_file(), reason="../shared/data is absent"),
]

TEAM = "dash"
OTHER = "dash-other"
WALL_S = 8.0
"""Budget of each compilation: enough for the baseline and a confirmation on a loaded CI."""
HOSTILE = "<script>window.pwned=1</script><img src=x onerror=alert(1)>"


@pytest_asyncio.fixture(scope="module")
async def stack(settings: KilnSettings) -> AsyncIterator[PoolStack]:
    async with dashboard_stack(settings, "kd") as s:
        yield s


@pytest_asyncio.fixture(scope="module")
async def compiled(stack: PoolStack) -> AsyncIterator[tuple[str, str]]:
    """(the team's compilation, another team's), both ended; a hostile board post on the
    first."""
    ours = await submit(stack, TEAM, 11, WALL_S)
    theirs = await submit(stack, OTHER, 12, WALL_S)
    await wait_ended(stack, TEAM, ours)
    await wait_ended(stack, OTHER, theirs)
    nc = await kn.connect(stack.settings.require_nats_url(), "test-dashboard")
    try:
        board = Board(nc.jetstream(), stack.settings.subject_prefix)
        await board.post_idea(ours, "hostile-1", "intruder", {"why": HOSTILE})
    finally:
        await nc.close()
    yield ours, theirs


async def test_pages_show_the_compilation_its_plot_experiments_and_baselines(
    stack: PoolStack, compiled: tuple[str, str], tmp_path: Path
) -> None:
    cid, _ = compiled
    async with (
        dashboard(stack, TEAM, tmp_path) as dash,
        httpx.AsyncClient(base_url=dash.url, timeout=30) as http,
    ):
        listing = await http.get("/")
        assert listing.status_code == 200, listing.text
        assert cid in listing.text and "llama-3.2-1b" in listing.text
        assert "cpu" in listing.text
        assert listing.headers["content-security-policy"].startswith("default-src 'none'")

        page = await http.get(f"/compilations/{cid}")
        assert page.status_code == 200, page.text
        html = page.text
        assert '<svg xmlns="http://www.w3.org/2000/svg" class="plot"' in html
        assert 'data-series="coordinate (fast)"' in html
        assert re.search(r'<table id="experiments">', html)
        assert html.count('<tr class="exp') >= 2
        assert 'data-agent="coordinate"' in html
        assert 'id="baselines"' in html and "kiln reference" in html
        assert "<summary>phases" in html  # each row's phases (the simulated engines record none)
        assert "succeeded" in html

        # Untrusted board text is shown, escaped.
        assert "intruder" in html
        assert "<script>window.pwned" not in html and "<img src=x" not in html
        assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in html

        filtered = await http.get(f"/compilations/{cid}", params={"tier": "full"})
        rows = re.findall(r'<tr class="exp[^"]*"[^>]*data-tier="(\w+)"', filtered.text)
        assert rows and set(rows) == {"full"}

        live = (await http.get(f"/api/compilations/{cid}")).json()
        assert live["ended"] is True and live["status"] == "succeeded"
        assert live["plot"].startswith("<svg") and live["experiments"]
        assert any(c["name"] == "coordinate (fast)" and c["points"] for c in live["curves"])

        deployments = await http.get("/deployments")
        assert deployments.status_code == 200 and "Deployments" in deployments.text

        js = await http.get("/static/dashboard.js")
        assert js.status_code == 200 and "applyFilters" in js.text


async def test_other_teams_and_bad_requests_get_4xx_with_one_line(
    stack: PoolStack, compiled: tuple[str, str], tmp_path: Path
) -> None:
    ours, theirs = compiled
    async with (
        dashboard(stack, TEAM, tmp_path) as dash,
        httpx.AsyncClient(base_url=dash.url, timeout=30) as http,
    ):
        other = await http.get(f"/compilations/{theirs}")
        unknown = await http.get(f"/compilations/nope-{uuid.uuid4().hex[:8]}")
        assert other.status_code == unknown.status_code == 404
        assert theirs not in (await http.get("/")).text
        api = await http.get(f"/api/compilations/{theirs}")
        assert api.status_code == 404 and "NOT_FOUND" in api.json()["error"]
        assert (await http.get("/compilations/bad%20id!")).status_code == 400
        assert (await http.get("/nowhere")).status_code == 404
        assert (await http.post(f"/compilations/{ours}")).status_code == 405
        rebinding = await http.get("/", headers={"Host": "evil.example:80"})
        assert rebinding.status_code == 403


async def test_a_non_loopback_listener_asks_for_its_token(
    stack: PoolStack, compiled: tuple[str, str], tmp_path: Path
) -> None:
    token = uuid.uuid4().hex
    env = {"KILN_DASHBOARD_TOKEN": token}
    async with dashboard(stack, TEAM, tmp_path, listen="0.0.0.0:0", extra_env=env) as dash:
        url = dash.url.replace("0.0.0.0", "127.0.0.1")
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            first = await http.get("/")
            assert first.status_code == 303 and first.headers["location"] == "/login"
            assert (await http.get("/api/compilations")).status_code == 401
            form = await http.get("/login")
            assert 'name="token"' in form.text
            wrong = await http.post("/login", data={"token": "wrong"})
            assert wrong.status_code == 401
            right = await http.post("/login", data={"token": token})
            assert right.status_code == 303
            assert "HttpOnly" in right.headers["set-cookie"]
            assert compiled[0] in (await http.get("/")).text  # the cookie is kept
        async with httpx.AsyncClient(base_url=url, timeout=30) as script:
            bearer = {"Authorization": f"Bearer {token}"}
            assert (await script.get("/api/compilations", headers=bearer)).status_code == 200
            bad = {"Authorization": "Bearer nope"}
            assert (await script.get("/api/compilations", headers=bad)).status_code == 401


async def test_report_is_one_self_contained_file(
    stack: PoolStack, compiled: tuple[str, str], tmp_path: Path
) -> None:
    cid, theirs = compiled
    env = cli_env(stack, TEAM, tmp_path)
    out = tmp_path / "report.html"
    code, text = await run_command(
        "-m", "kiln", "compilations", "report", cid, "--out", str(out), env=env
    )
    assert code == 0, text
    html = out.read_text()
    assert "<svg" in html and cid in html and 'id="experiments"' in html
    assert "<script" not in html.replace("&lt;script", "")
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing loads from elsewhere
    code, text = await run_command(
        "-m", "kiln", "compilations", "report", theirs, "--out", str(out), env=env
    )
    assert code == 1 and "NOT_FOUND" in text and "Traceback" not in text
    if find_browser() is not None:  # the PNG plots (headless chromium)
        png = tmp_path / "png"
        args = ["compilations", "report", cid, "--out", str(out), "--png", str(png)]
        code, text = await run_command("-m", "kiln", *args, env=env)
        assert code == 0, text
        assert (png / "best_so_far.png").read_bytes()[:4] == b"\x89PNG"
