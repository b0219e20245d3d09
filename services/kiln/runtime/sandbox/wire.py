"""The sandbox's wire format: one message is a JSON header and an optional binary payload over a
stream socket (``[4-byte header length][8-byte payload length][header][payload]``, big-endian).

Both sides read only JSON and raw bytes: the trusted side never unpickles what the sandbox sends.
Tensors cross as described in :mod:`kiln.runtime.sandbox.tensors`. Standard library only: the
sandbox reads its first message before it imports torch.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

MAX_HEADER = 1 << 20
"""Largest header accepted, bytes."""
MAX_PAYLOAD = 1 << 34
"""Largest payload accepted, bytes (a tensor the shared output buffer cannot hold)."""
_LENGTHS = struct.Struct(">IQ")


class WireError(ConnectionError):
    """The peer closed the socket, or sent something that is not a message."""


def send(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Send one message (blocking)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LENGTHS.pack(len(head), len(payload)) + head)
    if len(payload):
        sock.sendall(payload)


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise WireError("the peer closed the connection")
        got += k
    return buf


def receive(sock: socket.socket) -> tuple[dict[str, Any], bytearray]:
    """The next message ``(header, payload)``.

    Raises:
        WireError: EOF, an oversized or malformed message. socket.timeout: the socket's timeout.
    """
    head_len, payload_len = _LENGTHS.unpack(bytes(_exactly(sock, _LENGTHS.size)))
    if head_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise WireError(f"oversized message ({head_len} + {payload_len} bytes)")
    try:
        header = json.loads(bytes(_exactly(sock, head_len)))
    except ValueError as exc:
        raise WireError(f"malformed header: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("a header must be a JSON object")
    return header, _exactly(sock, payload_len) if payload_len else bytearray()
