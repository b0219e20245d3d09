"""A headless chromium driven over the DevTools protocol through ``--remote-debugging-pipe``
(fd 3: commands in, fd 4: replies out, NUL-separated JSON): no websocket client, no driver
download, no network (the flags turn the browser's own traffic off).

Blocking calls; from async tests run them with ``asyncio.to_thread`` so the services in the
test's event loop keep serving.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

from kiln.dashboard.png import FLAGS as PNG_FLAGS

CHROMIUM = os.environ.get("KILN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"

FLAGS = (*PNG_FLAGS, "--remote-debugging-pipe")
"""The report's headless flags (kiln.dashboard.png.FLAGS), driven over the DevTools pipe."""


def available() -> bool:
    """True when the chromium binary is there."""
    return os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)


class CdpError(RuntimeError):
    """The browser answered a command with an error, or went away."""


class Browser:
    """One headless chromium; :meth:`open` a page, :meth:`eval` JavaScript in it."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self._profile = tempfile.mkdtemp(prefix="kiln-chromium-")
        self._timeout = timeout_s
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Out of the way of 3 and 4, which the child gets by dup2 below.
        high_r = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 20)
        high_w = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 20)
        os.close(to_browser_r)
        os.close(from_browser_w)

        def wire() -> None:
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={self._profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=wire,
            pass_fds=(3, 4),
        )
        os.close(high_r)
        os.close(high_w)
        self._buf = b""
        self._next_id = 0

    def send(self, method: str, params: dict[str, Any] | None = None, session: str = "") -> Any:
        """The ``result`` of one command (events in between are dropped). Raises CdpError."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self._timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next_id:
                    if "error" in reply:
                        raise CdpError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0:
                raise CdpError(f"{method}: no reply within {self._timeout} s")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise CdpError("the browser closed its pipe")
                self._buf += chunk

    def open(self, url: str) -> str:
        """A new tab at ``url``; its session id."""
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        return str(attached["sessionId"])

    def eval(self, session: str, expression: str) -> Any:
        """The value of ``expression`` in the page (awaited when it is a promise)."""
        result = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session,
        )
        if "exceptionDetails" in result:
            raise CdpError(f"page exception: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def wait_for(self, session: str, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value. Raises CdpError on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.eval(session, expression)
            except CdpError:
                value = None  # the page is still loading
            if value:
                return value
            if time.monotonic() > deadline:
                raise CdpError(f"not true within {timeout_s} s: {expression}")
            time.sleep(0.2)

    def close(self) -> None:
        """Stop the browser (this process's child only) and remove its profile."""
        try:
            self.send("Browser.close")
        except (CdpError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)
