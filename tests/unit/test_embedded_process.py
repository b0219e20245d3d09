"""Process helpers of the embedded default (:mod:`kiln.embedded.process`)."""

from __future__ import annotations

import subprocess
import sys

from kiln.embedded.process import process_alive


def test_a_process_just_spawned_is_alive_by_its_command_line() -> None:
    """Right after ``Popen`` returns, ``/proc/<pid>/cmdline`` can still be empty (the child is
    between fork and exec): ``kiln up`` once took such a service for one that had exited."""
    code = "import time; time.sleep(5)"
    for _ in range(40):
        proc = subprocess.Popen(
            [sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL
        )
        try:
            assert process_alive(proc.pid, "time.sleep(5)")
            assert not process_alive(proc.pid, "kiln serve ledger")  # another program's pid
        finally:
            proc.kill()
            proc.wait()
    assert not process_alive(proc.pid, "time.sleep(5)")  # gone
