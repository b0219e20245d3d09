"""Running the dashboard: open the :class:`~kiln.dashboard.source.Source`, listen, serve until
cancelled. :data:`DEFAULT_LISTEN` is the documented address."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kiln.dashboard import http
from kiln.dashboard.access import Access
from kiln.dashboard.app import Dashboard, error
from kiln.dashboard.source import Source

DEFAULT_PORT = 9410
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"
"""Where ``kiln dashboard`` listens unless told (loopback only)."""


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) as (host, port). Raises ValueError."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--listen {listen!r}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--listen {listen!r}: the port is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--listen {listen!r}: the port must be 0..65535")
    return host.strip("[]"), port


async def serve(
    source: Source,
    access: Access,
    port: int,
    on_ready: Callable[[str], None] = lambda url: None,
) -> None:
    """Serve the dashboard on ``access.host:port`` until cancelled; ``on_ready(url)`` once it
    listens (port 0: the port chosen)."""
    async with source:
        app = Dashboard(source, access)
        server = await http.start(app, access.host, port, lambda s, m: error(s, m))
        sock_port = server.sockets[0].getsockname()[1]
        access.port = sock_port  # the session cookie is named after the port
        host = f"[{access.host}]" if ":" in access.host else access.host
        on_ready(f"http://{host}:{sock_port}/")
        async with server:
            try:
                await asyncio.Event().wait()
            finally:
                server.close()
