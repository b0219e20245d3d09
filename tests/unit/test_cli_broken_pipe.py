"""A kiln command whose reader closes the pipe early (``kiln ... | head``) stops quietly."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import typer
from kiln.cli.errors import KilnGroup

app = typer.Typer(cls=KilnGroup)

@app.command()
def lines() -> None:
    for i in range(200_000):
        print(f"line {i}")

@app.command()
def other() -> None:
    pass

app()
"""


def test_a_closed_pipe_ends_the_command_without_an_error_line() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, "lines"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline() == b"line 0\n"
    proc.stdout.close()  # what `head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141
    assert "error" not in err.lower() and "Traceback" not in err, err
