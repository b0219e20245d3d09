"""Who may open the dashboard's pages.

The dashboard acts with one team's certificate (whoever started it); its page users are not
kiln principals. So: by default it listens on loopback only, and checks the ``Host`` header
there (a page of another site cannot reach it by DNS rebinding). A non-loopback listener needs a
token (``KILN_DASHBOARD_TOKEN``, or one generated and printed at start): the page asks for it
(``/login``) and keeps it in an HttpOnly, SameSite=Strict cookie; scripts may send
``Authorization: Bearer <token>``. A token given for a loopback listener is enforced too.
"""

from __future__ import annotations

import hmac
import ipaddress
from dataclasses import dataclass

from kiln.dashboard.http import Request

COOKIE = "kiln_dashboard"
"""The cookie that carries the token."""

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Access:
    """The listener's host and its token ("" = none: loopback only)."""

    host: str
    token: str = ""

    def __post_init__(self) -> None:
        if not self.token and not is_loopback(self.host):
            raise ValueError(
                f"listening on {self.host} (not loopback) needs a token: set "
                "KILN_DASHBOARD_TOKEN or pass --token-file"
            )

    def host_allowed(self, request: Request) -> bool:
        """On loopback without a token: only a loopback ``Host`` header (anti DNS rebinding)."""
        if self.token or not is_loopback(self.host):
            return True
        name = request.headers.get("host", "")
        name = name.rsplit(":", 1)[0] if not name.endswith("]") else name
        return is_loopback(name) or name.strip("[]") in LOOPBACK_NAMES

    def token_ok(self, given: str) -> bool:
        """True when ``given`` is the token (constant-time), or no token is set."""
        if not self.token:
            return True
        return hmac.compare_digest(given.encode(), self.token.encode())

    def authorized(self, request: Request) -> bool:
        """The request carries the token (cookie or bearer header), or none is needed."""
        if not self.token:
            return True
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer ") and self.token_ok(bearer[7:].strip()):
            return True
        return bool(request.cookie(COOKIE)) and self.token_ok(request.cookie(COOKIE))

    def cookie_header(self) -> str:
        """The Set-Cookie value after a good login."""
        return f"{COOKIE}={self.token}; HttpOnly; SameSite=Strict; Path=/"
