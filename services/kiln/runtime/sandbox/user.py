"""The sandbox's unprivileged user (rationale: docs/design/engine.md, "Sandbox").

An engine that runs as root (the embedded default) starts its sandbox as root, and the sandbox
gives that up itself, before it imports torch or reads a candidate (:func:`drop_to`):
``setgroups([])``, ``setresgid``, ``setresuid`` to :func:`configured_user` (``KILN_SANDBOX_UID``,
default 65534 ``nobody``; ``KILN_SANDBOX_GID``, default that user's group), checked by trying to
become root again. It then reads only what any user may read: no root-only file (the signing
key, the CA key, ``/proc/<judge>/environ``), no file of the engine's outside world-readable
directories.

What it needs must stay readable: the interpreter's prefix and every ``sys.path`` entry (a
Python installed under ``/root`` is not, for ``/root`` is 0700). A child process probes them as
that user first; whatever it cannot reach gets a view of its own (:mod:`.view`: a private mount
namespace where a small tmpfs covers the unreachable directory, and the needed paths are bound
back at the same place). When they still cannot be reached, the sandbox stays root and says why
(a confinement note), as it does when the engine is not root at all (there is no other user to
become). The judge makes the sandbox's directory the user's (:meth:`SandboxUser.own`); its
socket and memfds are inherited descriptors, which need no permission.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import sys
from collections.abc import Mapping
from dataclasses import dataclass

UID_ENV = "KILN_SANDBOX_UID"
GID_ENV = "KILN_SANDBOX_GID"
NOBODY = 65534
MAX_ID = 2**32 - 2
"""Largest uid or gid (``(uid_t) -1`` means "unchanged" to the kernel)."""
_PR_SET_DUMPABLE = 4


@dataclass(frozen=True)
class SandboxUser:
    """The uid and gid a sandbox switches to (no supplementary groups)."""

    uid: int
    gid: int

    def own(self, path: str) -> None:
        """Make ``path`` (the sandbox's directory, 0700) this user's."""
        os.chown(path, self.uid, self.gid)
        os.chmod(path, 0o700)


def _id(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number (1..{MAX_ID})") from None
    if not 1 <= value <= MAX_ID:
        raise ValueError(f"{name}={value} is out of range (1..{MAX_ID}; 0 would be root)")
    return value


def configured_user(environ: Mapping[str, str] | None = None) -> SandboxUser:
    """``KILN_SANDBOX_UID`` (default :data:`NOBODY`) and ``KILN_SANDBOX_GID`` (default the uid's
    group in the password database, else the uid's number). ValueError naming the variable for
    a value that is not a number in 1..2^32-2."""
    env = os.environ if environ is None else environ
    uid = _id(UID_ENV, env[UID_ENV]) if env.get(UID_ENV) else NOBODY
    if env.get(GID_ENV):
        return SandboxUser(uid, _id(GID_ENV, env[GID_ENV]))
    try:
        return SandboxUser(uid, pwd.getpwuid(uid).pw_gid or uid)
    except KeyError:
        return SandboxUser(uid, uid)


def host_user(environ: Mapping[str, str] | None = None) -> SandboxUser | None:
    """The user the judge asks its sandbox to become: :func:`configured_user` when this process
    is root, else None (the sandbox keeps the engine's user)."""
    return configured_user(environ) if os.geteuid() == 0 else None


def needed_paths(home: str) -> list[str]:
    """What the sandbox reads after the switch: its directory, the interpreter's prefixes and
    every existing ``sys.path`` entry (absolute, deduplicated, in order)."""
    seen: dict[str, None] = {}
    for p in [home, sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path]:
        if p and os.path.exists(p):
            seen.setdefault(os.path.realpath(p), None)
    return list(seen)


def _become(user: SandboxUser) -> None:
    os.setgroups([])
    os.setresgid(user.gid, user.gid, user.gid)
    os.setresuid(user.uid, user.uid, user.uid)


def unreachable(user: SandboxUser, paths: list[str]) -> dict[str, str]:
    """Of ``paths``, those ``user`` cannot read, each with the first directory on its way that
    it cannot enter (the path itself when that is the one), probed in a child process that
    becomes ``user``. Call before torch is imported (it forks)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: never returns
        try:
            os.close(read)
            _become(user)
            lines = []
            for path in paths:
                if os.access(path, os.R_OK | os.X_OK if os.path.isdir(path) else os.R_OK):
                    continue
                parts = path.strip("/").split("/")
                blocker = path
                for i in range(1, len(parts)):
                    prefix = "/" + "/".join(parts[:i])
                    if not os.access(prefix, os.X_OK):
                        blocker = prefix
                        break
                lines.append(f"{path}\0{blocker}")
            os.write(write, "\n".join(lines).encode())
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read().decode()
    _, status = os.waitpid(pid, 0)
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return {p: p for p in paths}  # the probe failed: treat everything as unreachable
    return dict(line.split("\0", 1) for line in data.splitlines() if line)


def drop_to(user: SandboxUser, home: str) -> str:
    """Become ``user`` for good, giving the sandbox a view of what it needs first where it
    could not reach it (module docstring). Returns "" when done, else why this process stays
    root (one line). Exits the process (status 71) if root could be regained after the switch.
    """
    from kiln.runtime.sandbox.view import cover

    paths = needed_paths(home)
    blocked = unreachable(user, paths)
    if blocked:
        refused = cover(blocked)
        if refused:
            return f"stays root: {refused}"
        blocked = unreachable(user, paths)
        if blocked:
            path, at = next(iter(blocked.items()))
            return f"stays root: uid {user.uid} cannot read {path} (at {at}) even in its own view"
    try:
        _become(user)
    except OSError as exc:
        return f"stays root: switching to uid {user.uid} gid {user.gid}: {exc}"
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:  # a switch that can be undone is no switch
        os._exit(71)
    if os.getresuid() != (user.uid,) * 3 or os.getresgid() != (user.gid,) * 3:
        os._exit(71)
    # not ptrace-able by other processes of that uid (the kernel sets it on the switch already
    # unless fs.suid_dumpable says otherwise)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    return ""
