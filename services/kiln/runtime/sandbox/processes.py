"""The sandbox's processes (rationale: docs/design/engine.md, "Sandbox", "Processes").

Sandbox side, :func:`own_pid_namespace`: where the sandbox has a user namespace of its own, it
also takes a pid namespace. Three processes then: the one the judge started (the *keeper*, in
the host's namespace: it waits and exits as the server did), the namespace's init (pid 1: reaps
orphans, runs no candidate code) and the *server* (pid 2) that runs the candidates. Whatever the
candidate starts, double-forked and ``setsid`` or not, lives in that namespace: when init dies
(the judge kills it, or the keeper's death kills it through ``PR_SET_PDEATHSIG``, the judge's
death kills the keeper alike) the kernel kills every process in it. Where no pid namespace can
be had (CUDA: the host's namespaces are kept) the server is the started process itself and a
child subreaper (orphans of its descendants stay its descendants).

Judge side: :func:`descendants` (from ``/proc``, what the judge kills and the count of processes
a candidate left running) and :func:`host_pid` (a process's pid in the host's namespace).
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal

CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def host_pid() -> int:
    """This process's pid as the host's ``/proc`` knows it (``os.getpid()`` is the pid in its
    own namespace)."""
    return int(os.readlink("/proc/self"))


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` from ``/proc/<pid>/stat`` (0: gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first), from one scan of ``/proc``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            children.setdefault(parent_of(int(name)), []).append(int(name))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _close_all_but(keep: int) -> None:
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    os.closerange(3, keep)
    os.closerange(keep + 1, limit if limit != resource.RLIM_INFINITY else 65536)


def _exit_as(status: int) -> None:
    """Exit as a child that ended with wait ``status`` did (the same signal, or code)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught anyway
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _keeper(init: int, read: int) -> None:
    """The started process after the fork: wait for init, then exit as the server did."""
    _close_all_but(read)
    chunks = []
    while chunk := os.read(read, 64):
        chunks.append(chunk)
    _, status = os.waitpid(init, 0)
    text = b"".join(chunks).decode()
    _exit_as(int(text) if text.strip().lstrip("-").isdigit() else status)


def _init(server: int, write: int) -> None:
    """Pid 1: reap every orphan; when the server ends, tell the keeper how and exit (the
    kernel then kills what is left in the namespace)."""
    _close_all_but(write)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == server:
            os.write(write, str(status).encode())
            os._exit(0)


def own_pid_namespace(libc: ctypes.CDLL) -> str:
    """Become the server of a pid namespace of its own (module docstring); returns "" when
    done, else why not (then this process is the server, and a child subreaper). Call
    single-threaded, before torch is imported; returns only in the server."""
    if libc.unshare(CLONE_NEWPID) != 0:
        why = os.strerror(ctypes.get_errno())
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        return f"no pid namespace ({why}): a process it starts may outlive it if detached"
    read, write = os.pipe()
    init = os.fork()
    if init:
        os.close(write)
        _keeper(init, read)  # never returns
    os.close(read)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the keeper's death (the judge's) ends it
    server = os.fork()
    if server:
        _init(server, write)  # never returns
    os.close(write)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    return ""
