"""Files and directories only their owner reads: credentials, ``endpoints.json`` (it holds the
embedded PostgreSQL's password) and the logs, which carry every team's ids and errors.

Each helper creates with the narrow mode from the start (no window where a file is wider) and
narrows what an older kiln left wider. Why: docs/design/security.md, "PostgreSQL".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its parents) and set it to 0700; returns it."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically with mode 0600 from the start."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def open_private_log(path: Path) -> BinaryIO:
    """``path`` opened for appending (bytes), 0600, in a 0700 directory; an existing file is
    narrowed to 0600. The caller closes it."""
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "ab")


def touch_private(path: Path) -> None:
    """Create ``path`` empty with mode 0600 unless it exists, and narrow it to 0600 (a log a
    server opens itself then keeps that mode: servers open for append and keep the mode)."""
    with open_private_log(path):
        pass
