"""Where the tests find ``buf`` (https://buf.build; npm's ``@bufbuild/buf``): ``KILN_BUF``, else
``buf`` on PATH, else ``node_modules/.bin/buf`` of the checkout. ``.ci/run`` installs it and sets
``KILN_BUF``; elsewhere the tests that need it skip.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def buf_binary() -> str | None:
    """The buf executable, or None."""
    explicit = os.environ.get("KILN_BUF")
    if explicit:
        return explicit
    local = REPO_ROOT / "node_modules" / ".bin" / "buf"
    return shutil.which("buf") or (str(local) if local.is_file() else None)


def require_buf() -> str:
    """The buf executable; skips the test without one."""
    found = buf_binary()
    if found is None:
        pytest.skip("buf is not installed (npm install @bufbuild/buf, or set KILN_BUF)")
    return found
