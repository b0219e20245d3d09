"""Which sandbox confinement step keeps CUDA from starting: each variant in a fresh child
process (started as the engine's user) applies some of :func:`kiln.runtime.sandbox.confine`'s
steps, then initialises CUDA and allocates on the device; one line per variant.

    python3 benchmarks/sandbox_cuda_probe.py      # on a CUDA host, as the engine's user
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

STEPS = {
    "none": [],
    "user": ["user"],
    "no_new_privs": ["nnp"],
    "rlimits": ["rlimits"],
    "landlock": ["landlock"],
    "user+nnp": ["user", "nnp"],
    "user+landlock": ["user", "landlock"],
    "user(gid of /dev/nvidiactl)": ["devgid", "user"],
    "user(gid)+nnp+landlock": ["devgid", "user", "nnp", "landlock"],
    "nnp+landlock (root)": ["nnp", "landlock"],
    "nnp+landlock without own tasks": ["nnp", "landlock-old"],
    "nnp+landlock, / writable": ["nnp", "landlock-root"],
    "nnp+landlock fs only": ["nnp", "landlock-fs"],
    "nnp+landlock net+scopes only": ["nnp", "landlock-net"],
    "confine(network=False)": ["confine"],
}

CHILD = r"""
import ctypes, os, sys, json
steps = sys.argv[1].split(",") if sys.argv[1] else []
home = sys.argv[2]
from kiln.runtime.sandbox import confine as c
from kiln.runtime.sandbox.user import configured_user, drop_to
libc = ctypes.CDLL(None, use_errno=True)
notes = []
if "devgid" in steps and os.path.exists("/dev/nvidiactl"):
    os.environ["KILN_SANDBOX_GID"] = str(os.stat("/dev/nvidiactl").st_gid or 65534)
if "confine" in steps:
    notes += c.confine(os.getppid(), home, network=False,
                       user=configured_user() if os.geteuid() == 0 else None)
if "user" in steps:
    notes.append(drop_to(configured_user(), home) or "dropped")
if "nnp" in steps:
    libc.prctl(38, 1, 0, 0, 0)
if "rlimits" in steps:
    notes += c._rlimits(0)
if "landlock" in steps:
    dirs, files = c.writable_paths(home, True)
    notes.append(c._landlock(libc, dirs, files) or "landlocked")
if "landlock-old" in steps:
    dirs, files = c.writable_paths(home, True)
    dirs = [d for d in dirs if d != c.OWN_TASKS]
    notes.append(c._landlock(libc, dirs, files) or "landlocked")
if "landlock-root" in steps:
    notes.append(c._landlock(libc, ["/"], []) or "landlocked")
if "landlock-fs" in steps or "landlock-net" in steps:
    fs_only = "landlock-fs" in steps
    c._NET_TCP, c._SCOPES = (0, 0) if fs_only else (c._NET_TCP, c._SCOPES)
    dirs, files = c.writable_paths(home, True)
    notes.append(c._landlock(libc, dirs if fs_only else ["/"], files) or "landlocked")
import torch
try:
    n = torch.cuda.device_count()
    x = torch.ones(4, device="cuda") * 2
    out = {"ok": True, "devices": n, "sum": float(x.sum())}
except Exception as exc:
    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
print(json.dumps({**out, "uid": os.geteuid(), "gid": os.getegid(), "notes": notes}))
"""


def main() -> None:
    print("uid", os.geteuid(), "python", sys.executable, "cwd", os.getcwd())
    subprocess.run(
        "ls -l /dev/nvidia* /dev/nvidia-caps 2>&1; ls -ld / /root /tmp /tmp/site . 2>&1",
        shell=True,
        check=False,
    )
    for name, steps in STEPS.items():
        home = tempfile.mkdtemp(prefix="kiln-probe-")
        os.chmod(home, 0o777)
        r = subprocess.run(
            [sys.executable, "-c", CHILD, ",".join(steps), home],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        out = (r.stdout.strip().splitlines() or [""])[-1]
        err = r.stderr.strip()[-300:] if r.returncode else ""
        print(f"{name:26s} rc={r.returncode} {out} {err}")


if __name__ == "__main__":
    ctypes.CDLL(None)
    main()
