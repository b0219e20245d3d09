"""Threads doing a candidate's work after its call returned: :class:`ThreadWatch` names them,
:class:`OutsideWork` is what the engine raises when a timed call left one (module docstring of
:mod:`kiln.runtime.integrity`: what this sees and what it cannot)."""

from __future__ import annotations

import sys
import threading
import types

CANDIDATE_FILE_PREFIX = "<candidate:"
"""Code modules are compiled under ``<candidate:NAME#i>`` (see
:func:`kiln.runtime.reload.module_filename`)."""


def is_candidate_code(code: types.CodeType) -> bool:
    """True for code compiled from a candidate's code module."""
    return code.co_filename.startswith(CANDIDATE_FILE_PREFIX)


def _candidate_frame(frame: types.FrameType | None) -> str:
    """``function (file:line)`` of the innermost candidate frame on the stack, or ""."""
    while frame is not None:
        if is_candidate_code(frame.f_code):
            return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
        frame = frame.f_back
    return ""


def _candidate_target(thread: threading.Thread | None) -> str:
    """The candidate function a ``threading.Thread`` was started with, or ""."""
    target = getattr(thread, "_target", None)
    target = getattr(target, "func", target)  # functools.partial
    target = getattr(target, "__func__", target)  # bound method
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType) and is_candidate_code(code):
        return f"{code.co_name} ({code.co_filename})"
    run = getattr(type(thread), "run", None)
    code = getattr(run, "__code__", None)
    if isinstance(code, types.CodeType) and is_candidate_code(code):
        return f"{type(thread).__name__}.run ({code.co_filename})"
    return ""


class ThreadWatch:
    """Python threads besides the caller's, as of construction; :meth:`strays` names the ones
    doing candidate work now.

    Cost: one ``sys._current_frames()`` and a walk of each thread's stack (microseconds with
    the few threads an engine has).
    """

    def __init__(self) -> None:
        self._me = threading.get_ident()
        self._before = set(sys._current_frames())

    def strays(self, new_threads: bool = True) -> list[str]:
        """Threads other than the caller's that run candidate code (a candidate frame on their
        stack, or a candidate function as their target), and (``new_threads``) threads started
        after this watch was made that are still alive; one description each (empty: none)."""
        out: list[str] = []
        active = {t.ident: t for t in threading.enumerate()}  # for names and targets
        for ident, frame in sys._current_frames().items():
            if ident == self._me:
                continue
            thread = active.get(ident)
            name = thread.name if thread is not None else f"ident {ident}"
            where = _candidate_frame(frame) or _candidate_target(thread)
            if where:
                out.append(f"thread {name!r} runs candidate code: {where}")
            elif new_threads and ident not in self._before:
                out.append(f"thread {name!r} started during the call is still running")
        return out


class OutsideWork(RuntimeError):
    """A candidate kept working after its timed call returned (the message says where)."""
