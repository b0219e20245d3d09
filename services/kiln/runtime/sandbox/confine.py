"""What the sandbox process may do, set before any candidate code runs (rationale:
docs/design/engine.md, "Sandbox").

The judge starts it with :func:`sandbox_environment` (a short allow-list: no ``KILN_*``,
database, NATS or cloud credentials) and only its socket and shared-memory descriptors open.
The process then confines itself (:func:`confine`), before importing torch or reading a
candidate: started as root, it becomes an unprivileged user for good (:mod:`.user`); it dies
with the judge (``PR_SET_PDEATHSIG``, set again after the switch, which clears it), gains no
privileges
(``PR_SET_NO_NEW_PRIVS``), has no core dumps, at most ``RLIMIT_NOFILE`` descriptors, files of at
most ``RLIMIT_FSIZE``, a lifetime CPU cap and (CPU engines) an address-space cap; where the
kernel lets an unprivileged process, it leaves the host's network (a new user, network and
mount namespace: only a loopback that is down, an empty ``/dev/shm`` of its own), has at most
``RLIMIT_NPROC`` tasks there and a pid namespace of its own (:mod:`.processes`: nothing it
starts outlives it), and enters a Landlock domain (writes only beneath its own directory and
to a few device files, no TCP bind or connect, no signals or abstract-socket
connections to processes outside, and, as in any Landlock domain, no ptrace or
``/proc/<pid>/mem`` of the
judge). The order matters: the user first (the private view it may need takes root, and a
user namespace made as root would still own root's files), then the namespaces (an unprivileged
user may still make them) and Landlock last. Each step that the host refuses is reported, not
fatal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import struct
from collections.abc import Mapping

from kiln.runtime.sandbox.processes import own_pid_namespace
from kiln.runtime.sandbox.user import SandboxUser, drop_to

ENV_ALLOWED = (
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "TRITON_INTERPRET",
    "TORCHINDUCTOR_COMPILE_THREADS",
)
"""Variables of the judge's environment the sandbox inherits; everything else is dropped."""
NOFILE = 1024
"""Open descriptors the sandbox may hold."""
FSIZE = 1 << 30
"""Largest file the sandbox may write, bytes (compiled kernels, caches)."""
CPU_SECONDS = 4 * 3600
"""CPU time the sandbox process may use over its life, seconds (a runaway's cap; the judge's
deadline ends a hung call long before)."""
NPROC_BASE = 256
NPROC_PER_CPU = 4
"""``RLIMIT_NPROC`` of a sandbox: ``NPROC_BASE + NPROC_PER_CPU * os.cpu_count()`` tasks
(threads count: torch's intra- and inter-op pools are one thread per core each, inductor's
compile workers at most 32 processes), counted in its own user namespace (:func:`_nproc`)."""
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
"""Device files the sandbox may write (besides ``/dev/nvidia*``): no new file beneath ``/dev``."""

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_SYS_LANDLOCK = (444, 445, 446)  # create_ruleset, add_rule, restrict_self (x86_64 and aarch64)
_LL_CREATE_VERSION = 1
_LL_RULE_PATH_BENEATH = 1
_FS_WRITE = (
    (1 << 1)  # WRITE_FILE
    | (1 << 4)  # REMOVE_DIR
    | (1 << 5)  # REMOVE_FILE
    | (1 << 6)  # MAKE_CHAR
    | (1 << 7)  # MAKE_DIR
    | (1 << 8)  # MAKE_REG
    | (1 << 9)  # MAKE_SOCK
    | (1 << 10)  # MAKE_FIFO
    | (1 << 11)  # MAKE_BLOCK
    | (1 << 12)  # MAKE_SYM
)
_FS_FILE_WRITE = 1 << 1  # WRITE_FILE: the only write right a rule on a file may carry
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_NET_TCP = (1 << 0) | (1 << 1)  # BIND_TCP, CONNECT_TCP (ABI 4)
_SCOPES = (1 << 0) | (1 << 1)  # ABSTRACT_UNIX_SOCKET, SIGNAL (ABI 6)


def sandbox_environment(home: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The sandbox's environment: :data:`ENV_ALLOWED` from ``environ`` (default ``os.environ``),
    ``HOME``/``TMPDIR`` and the compiler caches under ``home``, and one-thread OpenMP spinning
    off (idle threads sleep)."""
    source = os.environ if environ is None else environ
    env = {k: source[k] for k in ENV_ALLOWED if k in source}
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update(
        HOME=home,
        TMPDIR=home,
        TORCHINDUCTOR_CACHE_DIR=os.path.join(home, "inductor"),
        TRITON_CACHE_DIR=os.path.join(home, "triton"),
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _errno_text() -> str:
    return os.strerror(ctypes.get_errno())


def _rlimits(address_space: int) -> list[str]:
    notes = []
    limits = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NOFILE, NOFILE),
        (resource.RLIMIT_FSIZE, FSIZE),
        (resource.RLIMIT_CPU, CPU_SECONDS),
    ]
    if address_space > 0:
        limits.append((resource.RLIMIT_AS, address_space))
    for which, value in limits:
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError) as exc:
            notes.append(f"rlimit {which}: {exc}")
    return notes


def _unshare_network(libc: ctypes.CDLL) -> str:
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWNS) != 0:
        return f"network kept: unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS): {_errno_text()}"
    return ""


def _nproc() -> str:
    """Cap the tasks of this process's uid in its (new) user namespace: since Linux 5.14 the
    count is per user namespace, and the host-wide count of the uid is checked against the
    limit in force when the namespace was made (kept as inherited), so other sandboxes of the
    same uid do not share this budget."""
    limit = NPROC_BASE + NPROC_PER_CPU * (os.cpu_count() or 1)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
    except (ValueError, OSError) as exc:
        return f"no process limit: {exc}"
    return ""


def _private_shm(libc: ctypes.CDLL) -> str:
    """A tmpfs of its own over ``/dev/shm`` (in the mount namespace of its user namespace): the
    host's shared memory files are out of sight. Nothing can be created in it (the sandbox's
    uid has no mapping in its user namespace: EOVERFLOW; nor may Landlock), so nothing there
    outlives the sandbox; torch on CPU does not use it."""
    if not os.path.isdir("/dev/shm"):
        return ""
    flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if libc.mount(b"kiln-sandbox-shm", b"/dev/shm", b"tmpfs", flags, b"mode=0755,size=64k") != 0:
        return f"the host's /dev/shm in view ({_errno_text()}), not writable"
    return ""


OWN_TASKS = "/proc/self/task"
"""The sandbox's own threads in ``/proc`` (resolved when the rule is made): CUDA names the
threads it starts by writing their ``comm`` there, and fails to initialise (error 304) when it
cannot. What is written there changes only the sandbox's own process."""


def writable_paths(home: str, shm: bool) -> tuple[list[str], list[str]]:
    """What the sandbox may write: directories (``home``, its own threads' ``/proc`` entries
    (:data:`OWN_TASKS`), and the host's ``/dev/shm`` when ``shm``) and device files
    (:data:`DEVICES`, ``/dev/nvidia*``)."""
    devices = [d for d in DEVICES if os.path.exists(d)]
    with contextlib.suppress(OSError):
        devices += sorted(
            e.path for e in os.scandir("/dev") if e.name.startswith("nvidia") and not e.is_dir()
        )
    return [home, OWN_TASKS, *(["/dev/shm"] if shm else [])], devices


def _landlock(libc: ctypes.CDLL, writable: list[str], files: list[str] | None = None) -> str:
    create, add, restrict = _SYS_LANDLOCK
    abi = libc.syscall(create, None, 0, _LL_CREATE_VERSION)
    if abi < 1:
        return f"no Landlock: {_errno_text()}"
    fs = _FS_WRITE | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    net = _NET_TCP if abi >= 4 else 0
    scoped = _SCOPES if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped)
    fd = libc.syscall(create, ctypes.c_char_p(attr), len(attr), 0)
    if fd < 0:
        return f"no Landlock ruleset: {_errno_text()}"
    try:
        file_rights = fs & (_FS_FILE_WRITE | _FS_TRUNCATE)
        for path, rights in [(p, fs) for p in writable] + [(f, file_rights) for f in files or []]:
            try:
                parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                rule = struct.pack("=Qi", rights, parent)
                if libc.syscall(add, fd, _LL_RULE_PATH_BENEATH, ctypes.c_char_p(rule), 0) != 0:
                    return f"Landlock rule for {path}: {_errno_text()}"
            finally:
                os.close(parent)
        if libc.syscall(restrict, fd, 0) != 0:
            return f"Landlock not enforced: {_errno_text()}"
    finally:
        os.close(fd)
    return ""


def _die_with(libc: ctypes.CDLL, judge_pid: int) -> None:
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != judge_pid:
        os._exit(70)


def confine(
    judge_pid: int,
    home: str,
    *,
    address_space: int = 0,
    network: bool = True,
    user: SandboxUser | None = None,
) -> list[str]:
    """Confine this process (module docstring); returns what the host refused, one line each.
    ``network``: also leave the host's network namespace (off where CUDA IPC needs the host's).
    ``user``: the user to become (the judge sends one when it is root; None: keep this one).
    Exits at once if the judge (``judge_pid``) is already gone."""
    libc = _libc()
    notes: list[str] = []
    _die_with(libc, judge_pid)
    if user is None and os.geteuid() == 0:
        notes.append("unprivileged user: none asked for, the sandbox stays root")
    elif user is None:
        notes.append(
            f"unprivileged user: the engine runs as uid {os.geteuid()}, not root, and the "
            "sandbox keeps that user"
        )
    elif os.geteuid() != 0:
        notes.append(f"unprivileged user: started as uid {os.geteuid()}, not root: kept")
    else:
        refused = drop_to(user, home)
        if refused:
            notes.append(f"unprivileged user: {refused}")
        _die_with(libc, judge_pid)  # a change of credentials clears the parent-death signal
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        notes.append(f"no_new_privs: {_errno_text()}")
    notes += _rlimits(address_space)
    own = False
    if network:
        refused = _unshare_network(libc)
        if refused:
            notes.append(refused)
        own = not refused
    if own:
        refused = _nproc()
        hidden = _private_shm(libc)
        refused_pids = own_pid_namespace(libc)  # forks: the server returns
        notes += [n for n in (refused, hidden, refused_pids) if n]
        shm = False
    else:  # the host's namespaces
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        notes.append(
            "no user namespace of its own: no process limit (RLIMIT_NPROC would count every "
            "process of its uid on the host), no pid namespace (a detached process it starts "
            "may outlive it), the host's /dev/shm writable"
        )
        shm = True
    dirs, files = writable_paths(home, shm)
    refused = _landlock(libc, dirs, files)
    if refused:
        notes.append(refused)
    return notes
