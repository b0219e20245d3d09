"""Who may open the dashboard's pages.

The dashboard acts with one team's certificate (whoever started it); its page users are not
kiln principals. So: by default it listens on loopback only, and checks the ``Host`` header
there (a page of another site cannot reach it by DNS rebinding). A non-loopback listener needs a
token (``KILN_DASHBOARD_TOKEN``, or one generated and printed at start; 16 or more printable
ASCII characters, no spaces, ``;``, ``,``, double quotes or backslashes): the page asks for it
(``/login``, at most :data:`LOGIN_FAILURES` wrong tries a minute) and then keeps a random session
id, never the token, in an HttpOnly, SameSite=Strict cookie named after the port (browsers send
a host's cookies to all its ports); scripts may send ``Authorization: Bearer <token>``. A token
given for a loopback listener is enforced too.
"""

from __future__ import annotations

import collections
import hmac
import ipaddress
import re
import secrets
import time
from dataclasses import dataclass, field

from kiln.dashboard.http import Request

COOKIE = "kiln_dashboard"
"""The session cookie's name, followed by ``_<port>``."""
MIN_TOKEN = 16
"""Fewest characters a token may have."""
_TOKEN = re.compile(r"[!#-+\--:<-\[\]-~]+")
"""Printable ASCII without space, quotes, ``,``, ``;`` or backslash (safe in a cookie and a
header)."""
LOGIN_FAILURES = 10
"""Wrong tokens accepted per minute (all clients together); more are 429 until it passes."""
MAX_SESSIONS = 1000
"""Sessions kept; the oldest is dropped past this."""


def check_token(token: str) -> None:
    """ValueError unless ``token`` is :data:`MIN_TOKEN`+ characters of :data:`_TOKEN`."""
    if len(token) < MIN_TOKEN:
        raise ValueError(f"a dashboard token needs {MIN_TOKEN} characters or more")
    if not _TOKEN.fullmatch(token):
        raise ValueError(
            "a dashboard token takes printable ASCII only, without spaces, double quotes, ',', "
            "';' or backslashes"
        )


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


@dataclass
class Access:
    """The listener's host, port and token ("" = none: loopback only), and the sessions of
    good logins. ValueError for a non-loopback host without a token or a malformed token."""

    host: str
    token: str = ""
    port: int = 0
    _sessions: collections.OrderedDict[str, None] = field(
        default_factory=collections.OrderedDict, repr=False
    )
    _failures: collections.deque[float] = field(default_factory=collections.deque, repr=False)

    def __post_init__(self) -> None:
        if not self.token and not is_loopback(self.host):
            raise ValueError(
                f"listening on {self.host} (not loopback) needs a token: set "
                "KILN_DASHBOARD_TOKEN or pass --token-file"
            )
        if self.token:
            check_token(self.token)

    @property
    def cookie_name(self) -> str:
        """``kiln_dashboard_<port>``."""
        return f"{COOKIE}_{self.port}"

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
        session = request.cookie(self.cookie_name)
        return bool(session) and session in self._sessions

    def login_allowed(self, now: float | None = None) -> bool:
        """False while :data:`LOGIN_FAILURES` wrong tokens came in the last minute."""
        now = time.monotonic() if now is None else now
        while self._failures and now - self._failures[0] > 60.0:
            self._failures.popleft()
        return len(self._failures) < LOGIN_FAILURES

    def login(self, given: str, now: float | None = None) -> str | None:
        """A new session's Set-Cookie value when ``given`` is the token, else None (counted
        against :meth:`login_allowed`)."""
        if not self.token_ok(given):
            self._failures.append(time.monotonic() if now is None else now)
            return None
        if not self.token:
            return ""
        session = secrets.token_urlsafe(32)
        self._sessions[session] = None
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return f"{self.cookie_name}={session}; HttpOnly; SameSite=Strict; Path=/"
