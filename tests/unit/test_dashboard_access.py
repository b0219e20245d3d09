"""Who may open the dashboard (kiln.dashboard.access), its request parsing
(kiln.dashboard.http) and routing (kiln.dashboard.app) over a stand-in source: loopback by
default with a Host check, a token required off loopback and asked for by the page, 4xx with a
message for bad input."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from kiln.common.errors import InvalidArgument, NotFound
from kiln.dashboard.access import Access, is_loopback
from kiln.dashboard.app import Dashboard
from kiln.dashboard.http import BadRequest, Request, encode, read_request
from kiln.dashboard.server import parse_listen

TOKEN = "s3cret-token-0123456789"


class FakeSource:
    """Answers as a Source with no compilations; ``bad`` ids raise as the Compiler API does."""

    settings = SimpleNamespace(team="t")

    async def compilations(self) -> list[Any]:
        return []

    async def deployments(self) -> list[Any]:
        return []

    async def compilation(self, cid: str, *, board: bool = False) -> Any:
        if cid == "bad id":
            raise InvalidArgument("malformed compilation id")
        raise NotFound(f"no compilation {cid!r}")


def _req(path: str, method: str = "GET", **headers: str) -> Request:
    hdrs = {"host": "127.0.0.1:9410", **{k.lower(): v for k, v in headers.items()}}
    return Request(method, path, {}, hdrs)


def _app(host: str = "127.0.0.1", token: str = "") -> Dashboard:
    return Dashboard(FakeSource(), Access(host, token))  # type: ignore[arg-type]


def _run(app: Dashboard, request: Request) -> Any:
    return asyncio.run(app(request))


def test_loopback_and_listen_parsing() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert parse_listen("127.0.0.1:9410") == ("127.0.0.1", 9410)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("9410", "host:", "host:x", "host:70000"):
        with pytest.raises(ValueError, match="--listen"):
            parse_listen(bad)


def test_off_loopback_a_token_is_required() -> None:
    with pytest.raises(ValueError, match="needs a token"):
        Access("0.0.0.0")
    Access("0.0.0.0", TOKEN)


def test_loopback_serves_only_loopback_host_headers() -> None:
    app = _app()
    assert _run(app, _req("/")).status == 200
    assert _run(app, _req("/", host="localhost:9410")).status == 200
    assert _run(app, _req("/", host="evil.example")).status == 403


def test_a_token_is_asked_for_and_checked() -> None:
    app = _app("0.0.0.0", TOKEN)
    page = _run(app, _req("/"))
    assert page.status == 303 and page.headers["Location"] == "/login"
    assert _run(app, _req("/api/compilations")).status == 401
    assert b'name="token"' in _run(app, _req("/login")).body
    wrong = _req("/login", "POST")
    wrong.form = {"token": "nope"}
    assert _run(app, wrong).status == 401
    right = _req("/login", "POST")
    right.form = {"token": TOKEN}
    reply = _run(app, right)
    assert reply.status == 303 and "HttpOnly" in reply.headers["Set-Cookie"]
    cookie = reply.headers["Set-Cookie"].split(";")[0]
    assert _run(app, _req("/", cookie=cookie)).status == 200
    assert _run(app, _req("/", cookie="kiln_dashboard=nope")).status == 303
    assert _run(app, _req("/api/compilations", authorization=f"Bearer {TOKEN}")).status == 200
    assert _run(app, _req("/static/dashboard.js")).status == 200  # no data in it


def test_errors_are_4xx_with_one_line() -> None:
    app = _app()
    missing = _run(app, _req("/compilations/nope"))
    assert missing.status == 404 and b"NOT_FOUND: no compilation" in missing.body
    api = _run(app, _req("/api/compilations/bad%20id"))
    assert api.status == 400 and api.content_type == "application/json"
    assert b"INVALID_ARGUMENT" in api.body
    assert _run(app, _req("/compilations/")).status == 404
    assert _run(app, _req("/nowhere")).status == 404
    assert _run(app, _req("/", "DELETE")).status == 405


async def _parse(raw: bytes) -> Request:
    reader = asyncio.StreamReader(limit=16 * 1024)
    reader.feed_data(raw)
    reader.feed_eof()
    return await read_request(reader)


def test_request_parsing_and_bad_requests() -> None:
    req = asyncio.run(_parse(b"GET /compilations/x?tier=fast&x=1 HTTP/1.1\r\nHost: h\r\n\r\n"))
    assert (req.method, req.path, req.query["tier"], req.headers["host"]) == (
        "GET",
        "/compilations/x",
        "fast",
        "h",
    )
    body = b"token=abc%3D"
    post = asyncio.run(
        _parse(b"POST /login HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    )
    assert post.form == {"token": "abc="}
    for raw, status in (
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/2\r\n\r\n", 505),
        (b"POST /login HTTP/1.1\r\nContent-Length: 99999\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    ):
        with pytest.raises(BadRequest) as err:
            asyncio.run(_parse(raw))
        assert err.value.status == status
    wire = encode(_run(_app(), _req("/")))
    assert wire.startswith(b"HTTP/1.1 200 OK\r\n") and b"Content-Security-Policy" in wire


def test_the_cookie_holds_a_session_not_the_token() -> None:
    """Browsers send a host's cookies to every port: the cookie is a random session id named
    after the port, so another service on the host learns nothing that opens the dashboard."""
    app = Dashboard(FakeSource(), Access("0.0.0.0", TOKEN, 9480))  # type: ignore[arg-type]
    reply = _run(app, Request("POST", "/login", {}, {"host": "h"}, form={"token": TOKEN}))
    name, _, session = reply.headers["Set-Cookie"].split(";")[0].partition("=")
    assert name == "kiln_dashboard_9480" and TOKEN not in reply.headers["Set-Cookie"]
    assert _run(app, _req("/", cookie=f"{name}={session}")).status == 200
    assert _run(app, _req("/", cookie=f"{name}={TOKEN}")).status == 303  # the token is no session
    assert _run(app, _req("/", cookie=f"kiln_dashboard_9481={session}")).status == 303
    again = Dashboard(FakeSource(), Access("0.0.0.0", TOKEN, 9480))  # type: ignore[arg-type]
    assert _run(again, _req("/", cookie=f"{name}={session}")).status == 303  # a restart forgets


@pytest.mark.parametrize(
    ("token", "why"),
    [("a", "16 characters"), ("x" * 15, "16 characters"), ("tök€n-0123456789abcdef", "ASCII"),
     ("abc;def0123456789xyz", "ASCII"), ("with space 0123456789", "ASCII")],
)  # fmt: skip
def test_weak_or_unsafe_tokens_are_refused(token: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Access("0.0.0.0", token)


def test_wrong_tokens_are_limited() -> None:
    from kiln.dashboard.access import LOGIN_FAILURES

    app = _app("0.0.0.0", TOKEN)

    def login(token: str) -> int:
        return int(
            _run(app, Request("POST", "/login", {}, {"host": "h"}, form={"token": token})).status
        )

    assert [login("wrong-token-0000000") for _ in range(LOGIN_FAILURES)] == [401] * LOGIN_FAILURES
    assert login(TOKEN) == 429  # even the right one, until the minute passes
    assert app.access.login_allowed(now=1e12)


def test_a_failing_handler_is_a_500_not_a_dropped_reply() -> None:
    from kiln.dashboard import http
    from kiln.dashboard.app import error

    async def broken(request: Request) -> Any:
        raise RuntimeError("bug")

    async def main() -> bytes:
        server = await http.start(broken, "127.0.0.1", 0, lambda s, m: error(s, m))
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        data = await reader.read()
        writer.close()
        server.close()
        return data

    reply = asyncio.run(main())
    assert reply.startswith(b"HTTP/1.1 500") and b"RuntimeError" in reply
