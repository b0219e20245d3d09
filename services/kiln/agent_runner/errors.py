"""The agent runner's own error: a compilation that cannot go on."""

from __future__ import annotations


class Failure(Exception):
    """The compilation cannot go on; ``reason`` (readable, naming the cause) is recorded in its
    ``CompilationEnded`` with status ``failed``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
