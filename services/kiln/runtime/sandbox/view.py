"""The sandbox's own view of the file system, for what its unprivileged user could not reach
otherwise (rationale: docs/design/engine.md, "Sandbox"; the caller: :mod:`.user`).

A directory on the way to a needed path that the user may not enter (``/root``, 0700, above a
Python installed with pyenv) is covered, in a private mount namespace, by a small read-only tmpfs
(0755) in which only the needed paths are bound back, at the same place: the interpreter finds
its standard library, C headers and extensions where it was built to, and nothing else of that
directory is there. Needs root (``CAP_SYS_ADMIN``); runs before the switch of user. The bound
paths keep their own permissions, and the mounts are the sandbox's alone (made private first:
nothing propagates to the host). A process that later enters a user namespace of its own cannot
unmount them to see beneath (mounts from a more privileged namespace are locked), and Landlock
forbids mount changes anyway.
"""

from __future__ import annotations

import ctypes
import os
import stat

_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REMOUNT = 32
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


def _outermost(paths: list[str]) -> list[str]:
    """``paths`` without those beneath another one of them."""
    keep: list[str] = []
    for p in sorted(set(paths), key=len):
        if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in keep):
            keep.append(p)
    return keep


def cover(blocked: dict[str, str]) -> str:
    """Give this process a view in which each needed path of ``blocked`` (path -> the directory
    on its way its user cannot enter) is reachable (module docstring). Returns "" when done,
    else why not (one line); a partly made view stays (it only hides)."""
    groups: dict[str, list[str]] = {}
    for path, blocker in blocked.items():
        if blocker == path:
            return f"{path} itself is not readable by that user"
        groups.setdefault(blocker, []).append(path)
    libc = ctypes.CDLL(None, use_errno=True)

    def failed(what: str) -> str:
        return f"{what}: {os.strerror(ctypes.get_errno())}"

    if libc.unshare(_CLONE_NEWNS) != 0:
        return failed("no mount namespace of its own to make " + ", ".join(groups) + " passable")
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return failed("mounts not made private")
    for blocker in _outermost(list(groups)):
        inside = [b for b in groups if b == blocker or b.startswith(blocker + "/")]
        needed = _outermost([p for b in inside for p in groups[b]])
        fds = [(p, os.open(p, os.O_PATH | os.O_CLOEXEC)) for p in needed]
        try:
            flags = _MS_NOSUID | _MS_NODEV
            options = b"mode=0755,size=1m"
            if libc.mount(b"kiln-sandbox-view", blocker.encode(), b"tmpfs", flags, options) != 0:
                return failed(f"tmpfs over {blocker}")
            for path, fd in fds:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.makedirs(path, mode=0o755, exist_ok=True)
                else:
                    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
                source = f"/proc/self/fd/{fd}".encode()
                if libc.mount(source, path.encode(), None, _MS_BIND | _MS_REC, None) != 0:
                    return failed(f"bind {path}")
        finally:
            for _, fd in fds:
                os.close(fd)
        remount = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags
        if libc.mount(None, blocker.encode(), None, remount, None) != 0:
            return failed(f"tmpfs over {blocker} read-only")
    return ""
