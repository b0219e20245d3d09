"""A work item as the engine pool runs it: the :class:`~kiln.common.work.ExperimentWork` and its
candidate, parsed once where the work enters the pool (the RunExperiment servicer, from the proto;
the work queue's delivery, from the message's JSON). From there on the pool, the engine process's
request (:class:`~kiln.runtime.request.RunRequest`) and the measurements carry the parsed
candidate and its content-addressed id.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.common.errors import InvalidArgument
from kiln.common.work import ExperimentWork
from kiln.domain.candidate import Candidate

MALFORMED = (KeyError, TypeError, ValueError, AttributeError)
"""What ``Candidate.from_canonical`` and ``Candidate.from_proto`` raise for a malformed
candidate."""


def malformed(exc: Exception) -> InvalidArgument:
    """The error a malformed candidate is reported as: ``malformed candidate: <exc>``."""
    return InvalidArgument(f"malformed candidate: {exc!r}")


@dataclass(frozen=True)
class Job:
    """One experiment for the pool: ``work`` and ``candidate``, its candidate parsed."""

    work: ExperimentWork
    candidate: Candidate

    @staticmethod
    def of(work: ExperimentWork) -> Job:
        """``work`` with its candidate (``Candidate.canonical()`` form) parsed.

        Raises:
            InvalidArgument: a malformed candidate (:func:`malformed`).
        """
        try:
            return Job(work, Candidate.from_canonical(work.candidate))
        except MALFORMED as exc:
            raise malformed(exc) from None
