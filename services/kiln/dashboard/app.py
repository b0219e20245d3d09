"""The dashboard's routes: pages and JSON over a :class:`~kiln.dashboard.source.Source`.

| path | what |
| --- | --- |
| ``/`` | compilations (status, outcome, model, hardware, best tok/s) |
| ``/compilations/<id>`` | plot, baselines, experiments (``?status=&tier=&agent=``), board |
| ``/api/compilations/<id>`` | its live JSON (fragments the page's script swaps in) |
| ``/api/compilations`` | the list as JSON |
| ``/deployments`` | deployments |
| ``/login`` | asks for the token (non-loopback listeners) |
| ``/static/dashboard.js`` | the page script |

Errors: a kiln error maps to its HTTP kind (NOT_FOUND 404, INVALID_ARGUMENT 400,
PERMISSION_DENIED 403, UNAVAILABLE 503, else 502) with one line; unknown paths 404; methods
other than GET (POST for ``/login``) 405.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from kiln.common.errors import (
    InvalidArgument,
    KilnError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kiln.dashboard.access import Access
from kiln.dashboard.assets import JS
from kiln.dashboard.compilation_page import FILTERS, compilation_page, live_json
from kiln.dashboard.http import Request, Response
from kiln.dashboard.pages import compilations_page, deployments_page, error_page, login_page
from kiln.dashboard.source import Source
from kiln.dashboard.view import status_name


def _html(text: str, status: int = 200) -> Response:
    return Response(status, text.encode())


def _json(data: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(data).encode(), "application/json")


def error(status: int, message: str, *, api: bool = False) -> Response:
    """A 4xx/5xx reply: JSON ``{"error": ...}`` for the API, a page otherwise."""
    return _json({"error": message}, status) if api else _html(error_page(status, message), status)


def _status_of(exc: KilnError) -> int:
    for kind, status in (
        (NotFound, 404),
        (InvalidArgument, 400),
        (PermissionDenied, 403),
        (Unauthenticated, 401),
        (Unavailable, 503),
    ):
        if isinstance(exc, kind):
            return status
    return 502


class Dashboard:
    """Routes requests; ``source`` is open for the dashboard's lifetime."""

    def __init__(self, source: Source, access: Access) -> None:
        self.source = source
        self.access = access
        self.team = source.settings.team

    async def __call__(self, request: Request) -> Response:
        """The reply to one request."""
        api = request.path.startswith("/api/")
        if not self.access.host_allowed(request):
            return error(403, "this dashboard answers only to a loopback Host", api=api)
        if request.path == "/login":
            return self._login(request)
        if request.method != "GET":
            return error(405, f"{request.method} is not served here", api=api)
        if request.path == "/static/dashboard.js":
            return Response(200, JS.encode(), "text/javascript; charset=utf-8")
        if not self.access.authorized(request):
            if api:
                return error(401, "the dashboard's token is required", api=True)
            return Response(303, b"", headers={"Location": "/login"})
        try:
            return await self._route(request, api)
        except Unavailable as exc:
            message = f"UNAVAILABLE: {exc.message} (is kiln up? start it with `kiln up`)"
            return error(503, message, api=api)
        except KilnError as exc:
            return error(_status_of(exc), f"{exc.code.name}: {exc.message}", api=api)

    def _login(self, request: Request) -> Response:
        if request.method == "GET":
            return _html(login_page())
        if request.method != "POST":
            return error(405, f"{request.method} is not served here")
        if not self.access.login_allowed():
            return _html(login_page("too many wrong tokens: wait a minute"), 429)
        cookie = self.access.login(request.form.get("token", ""))
        if cookie is None:
            return _html(login_page("wrong token"), 401)
        headers = {"Location": "/"}
        if cookie:
            headers["Set-Cookie"] = cookie
        return Response(303, b"", headers=headers)

    async def _route(self, request: Request, api: bool) -> Response:
        path = request.path
        if path == "/":
            return _html(compilations_page(await self.source.compilations(), self.team))
        if path == "/deployments":
            return _html(deployments_page(await self.source.deployments(), self.team))
        if path == "/api/compilations":
            comps = await self.source.compilations()
            return _json(
                [
                    {
                        "compilation_id": c.compilation_id,
                        "status": status_name(c.status),
                        "model": c.workload.model.name,
                        "hardware": c.workload.hardware.name,
                        "experiments": c.experiments_done,
                    }
                    for c in comps
                ]
            )
        for prefix, is_api in (("/api/compilations/", True), ("/compilations/", False)):
            if path.startswith(prefix):
                cid = unquote(path[len(prefix) :])
                if not cid or "/" in cid:
                    break
                if is_api:
                    return _json(live_json(await self.source.compilation(cid)))
                filters = {k: request.query[k] for k in FILTERS if request.query.get(k)}
                view = await self.source.compilation(cid, board=True)
                return _html(compilation_page(view, filters, self.team))
        return error(404, f"no page at {path[:200]}", api=api)
