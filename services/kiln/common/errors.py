"""Errors that carry their gRPC status code.

Domain code raises these; the service runtime turns them into a gRPC status with the message
(``kiln.common.server``), and clients turn a status back into the same class
(:func:`from_rpc_error`), so CLI and services speak one error vocabulary.

Messages are bounded: a quoted input goes through :func:`quote` (at most ``MAX_QUOTE_CHARS``
of its ``repr``), and every message is cut to ``MAX_MESSAGE_CHARS`` when the error is made, so a
hostile 1 MB input never comes back whole (gRPC carries the message in a trailer of 8 KiB by
default; a longer one turns the reply into RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import grpc

from kiln.domain.quoting import MAX_MESSAGE_CHARS as MAX_MESSAGE_CHARS
from kiln.domain.quoting import MAX_QUOTE_CHARS as MAX_QUOTE_CHARS
from kiln.domain.quoting import bounded
from kiln.domain.quoting import quote as quote


class KilnError(Exception):
    """Base error; ``code`` is the gRPC status it maps to; ``message`` is :func:`bounded`."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message


class InvalidArgument(KilnError):
    """Malformed input: bad id, unknown event type, payload failing its schema."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class OutOfRange(InvalidArgument):
    """A number outside the range the field accepts (devices, layers, positions, sizes); the
    message names the field, the value and the range. A kind of InvalidArgument (``except
    InvalidArgument`` catches it) with its own status."""

    code = grpc.StatusCode.OUT_OF_RANGE


class DeadlineExceeded(KilnError):
    """The work did not finish within the service's own time limit (e.g. planning)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(KilnError):
    """The named thing does not exist (stream, compilation, hardware)."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KilnError):
    """An id was used before for something else."""

    code = grpc.StatusCode.ALREADY_EXISTS


class Aborted(KilnError):
    """A concurrency conflict, e.g. a stale expected stream version; re-read and retry."""

    code = grpc.StatusCode.ABORTED


class FailedPrecondition(KilnError):
    """The system is not in the state the call needs."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(KilnError):
    """The call carries no (valid) team identity."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KilnError):
    """The caller's team may not do this to another team's resource (e.g. cancel its
    compilation)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KilnError):
    """A size or rate limit was exceeded (e.g. an oversized event payload)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unimplemented(KilnError):
    """The RPC exists in the contract but is not built yet."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Unavailable(KilnError):
    """A backing server (PostgreSQL, NATS) cannot be reached; retry later."""

    code = grpc.StatusCode.UNAVAILABLE


_BY_CODE: dict[grpc.StatusCode, type[KilnError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        OutOfRange,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        Aborted,
        FailedPrecondition,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        Unimplemented,
        Unavailable,
    )
}


def from_rpc_error(err: grpc.RpcError) -> KilnError:
    """The KilnError for a failed call (``grpc.aio.AioRpcError`` or a sync ``RpcError``)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    cls = _BY_CODE.get(code, KilnError)
    exc = cls(details or str(code))
    exc.code = code
    return exc
