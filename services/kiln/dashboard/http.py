"""A minimal HTTP/1.1 server on asyncio streams, enough for the dashboard: GET and POST with a
small form body, one request per connection (``Connection: close``), no TLS.

It runs in the same event loop as the gRPC clients (gRPC's asyncio support wants one loop), which
``http.server``'s threads would not. A malformed request gets a 400 with one line; a body over
:data:`MAX_BODY` a 413; a request that does not arrive within :data:`READ_TIMEOUT_S` is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import structlog

log = structlog.get_logger("kiln.dashboard.http")

MAX_HEADER = 16 * 1024
MAX_BODY = 8 * 1024
READ_TIMEOUT_S = 10.0

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; img-src data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
"""Sent on every response: only the dashboard's own script runs; nothing loads from elsewhere."""


@dataclass
class Request:
    """One parsed request: ``query`` and ``form`` hold the first value of each parameter."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    form: dict[str, str] = field(default_factory=dict)
    peer: str = ""

    def cookie(self, name: str) -> str:
        """The value of cookie ``name`` ("" when absent)."""
        for part in self.headers.get("cookie", "").split(";"):
            key, _, value = part.strip().partition("=")
            if key == name:
                return value
        return ""


@dataclass
class Response:
    """Status, body and headers of one reply."""

    status: int
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]


class BadRequest(Exception):
    """A request the server cannot parse; ``status`` is its reply's code."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _first(values: dict[str, list[str]]) -> dict[str, str]:
    return {k: v[0] for k, v in values.items() if v}


async def read_request(reader: asyncio.StreamReader) -> Request:
    """Parse one request from ``reader``. Raises BadRequest."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise BadRequest("request header too large", 431) from None
    except asyncio.IncompleteReadError:
        raise BadRequest("incomplete request") from None
    try:
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest("malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest("only HTTP/1.x is served", 505)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadRequest("malformed header line")
        headers[name.strip().lower()] = value.strip()
    url = urlsplit(target)
    request = Request(method.upper(), url.path or "/", _first(parse_qs(url.query)), headers)
    if request.method == "POST":
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            raise BadRequest("malformed Content-Length") from None
        if length < 0 or length > MAX_BODY:
            raise BadRequest(f"request body over {MAX_BODY} bytes", 413)
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise BadRequest("incomplete request body") from None
        request.form = _first(parse_qs(body.decode("utf-8", "replace")))
    return request


def encode(response: Response) -> bytes:
    """The wire bytes of ``response``."""
    reason = HTTPStatus(response.status).phrase
    headers = {
        "Content-Type": response.content_type,
        "Content-Length": str(len(response.body)),
        "Connection": "close",
        **SECURITY_HEADERS,
        **response.headers,
    }
    head = f"HTTP/1.1 {response.status} {reason}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("latin-1") + response.body


async def start(
    handler: Handler, host: str, port: int, on_error: Callable[[int, str], Response]
) -> asyncio.Server:
    """Listen on ``host:port`` (port 0: any free one); each request goes to ``handler``;
    parse failures to ``on_error(status, message)``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            try:
                request = await asyncio.wait_for(read_request(reader), READ_TIMEOUT_S)
                request.peer = str(peer[0]) if peer else ""
                response = await handler(request)
            except BadRequest as exc:
                response = on_error(exc.status, str(exc))
            except TimeoutError:
                return
            except Exception as exc:  # a handler's bug: a 500 with one line, never a dropped reply
                log.error("dashboard request failed", exc_info=exc)
                response = on_error(500, f"internal error: {type(exc).__name__}")
            try:
                data = encode(response)
            except UnicodeEncodeError:
                data = encode(on_error(500, "internal error: a header is not latin-1"))
            writer.write(data)
            await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    return await asyncio.start_server(serve, host, port, limit=MAX_HEADER)
