"""What the judge reads besides code, checked by content (rationale and limits:
docs/design/engine.md, "State").

- :class:`StateGuard`: the tensors the reference models read (every tensor their op sites bind:
  the weight store's, RoPE tables; plus the engine's context lengths), each named, with a
  digest of its content; :meth:`StateGuard.check` raises :class:`StateChanged` naming those that
  differ. On CPU the digest is SHA-256 of the bytes, taken once at build. On CUDA it is
  :func:`keyed_checksum` on the device, with a key drawn from OS entropy by
  :meth:`StateGuard.begin` (each experiment).
- The tolerance table ``kiln.runtime.check.TOLERANCES`` (and ``LOSSY_RTOL``): immutable tuples
  of floats, whose content is recorded at import; :func:`tolerance_changes` names a change
  (only ctypes writes a float in place; rebinding is the fingerprint's), :func:`restore_tolerances`
  writes the recorded values back into the same objects. :func:`rtol_for` reads the table.
"""

from __future__ import annotations

import ctypes
import hashlib
import secrets
import struct
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.runtime import check
from kiln.workloads.models import DecoderModel
from kiln.workloads.weights import WeightStore

Tensor = torch.Tensor

KEY_WORDS = 4096
"""Length of a keyed checksum's word multipliers (a tensor is read as rows of this many words)."""
CHUNK_WORDS = 1 << 24
"""Words per pass of :func:`keyed_checksum` (bounds its int64 temporaries to 128 MiB each)."""
HASH_BYTES = 1 << 25
"""Bytes per SHA-256 of :func:`host_digests` (pieces of one tensor hash on several threads)."""
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = (-4658895280553007687, -7723592293110705685)  # splitmix64's multipliers, as int64
SHOWN = 4
"""Changed tensors named in a :class:`StateChanged` message."""


class StateChanged(Exception):
    """State the reference reads differs from its recorded content; the message names it."""


def rtol_for(dtype: torch.dtype) -> float:
    """``rtol`` of ``dtype``'s row of ``kiln.runtime.check.TOLERANCES``; KeyError if none."""
    return check.tolerance_for(dtype).rtol


def _table_floats() -> list[float]:
    """Every float of the table, in order: each row's numbers, then ``LOSSY_RTOL``."""
    floats = [v for row in check.TOLERANCES for v in row if isinstance(v, float)]
    return [*floats, check.LOSSY_RTOL]


def _packed(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


TABLE_CHANGED = "kiln.runtime.check.TOLERANCES differs from its content at import"
"""Start of :func:`tolerance_changes`' line."""
_RECORDED = _packed(_table_floats())
"""The table's floats at import, packed (bytes, not floats a ctypes write could reach too)."""
_VALUE_OFFSET = float.__basicsize__ - ctypes.sizeof(ctypes.c_double)


def tolerance_changes() -> list[str]:
    """One line when the table's floats differ from their content at import, else []."""
    now = _table_floats()
    if _packed(now) == _RECORDED:
        return []
    shown = ", ".join(f"{v:g}" for v in now)
    return [f"{TABLE_CHANGED} (now {shown})"]


def restore_tolerances() -> None:
    """Write the recorded values back into the table's float objects (the same objects: a value
    written in place through ctypes is put back the same way)."""
    recorded = struct.unpack(f"<{len(_RECORDED) // 8}d", _RECORDED)
    now = _table_floats()
    if len(now) != len(recorded):  # the table rebound: the fingerprint puts it back
        return
    for value, want in zip(now, recorded, strict=True):
        if _packed([value]) != _packed([want]):
            ctypes.c_double.from_address(id(value) + _VALUE_OFFSET).value = want


def _words(t: Tensor) -> Tensor:
    """``t``'s elements as a flat tensor of same-width integers (a copy only if not
    contiguous)."""
    flat = t.detach().reshape(-1)
    return flat.view(_WORD[flat.element_size()])


def _pieces(t: Tensor) -> list[memoryview]:
    """A CPU tensor's element bytes in pieces of :data:`HASH_BYTES` (at least one)."""
    data = _words(t).view(torch.uint8).numpy().data
    return [data[i : i + HASH_BYTES] for i in range(0, max(1, len(data)), HASH_BYTES)]


def _sha256(piece: memoryview) -> bytes:
    return hashlib.sha256(piece).digest()


def host_digests(tensors: Sequence[Tensor]) -> list[tuple[bytes, ...]]:
    """Per CPU tensor, the SHA-256 of each :data:`HASH_BYTES` piece of its element bytes, hashed
    on ``torch.get_num_threads()`` threads (hashlib releases the GIL)."""
    pieces = [(i, piece) for i, t in enumerate(tensors) for piece in _pieces(t)]
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        hashes = list(pool.map(_sha256, [piece for _, piece in pieces]))
    out: list[list[bytes]] = [[] for _ in tensors]
    for (i, _), digest in zip(pieces, hashes, strict=True):
        out[i].append(digest)
    return [tuple(digests) for digests in out]


def _mix(z: Tensor) -> Tensor:
    """splitmix64's finaliser, elementwise on int64 (wrapping; shifts made logical by masks)."""
    for shift, mul in ((30, _MIX[0]), (27, _MIX[1])):
        z = (z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))) * mul
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def keyed_checksum(t: Tensor, words: Tensor, key: int) -> Tensor:
    """``sum_r mix(key + r) * sum_j x[r, j] * words[j]`` mod 2**64, computed on ``t``'s device:
    ``x`` is ``t`` read as integers (its bit patterns), in rows of ``len(words)``.

    Args:
        words: ``[KEY_WORDS]`` int64 random multipliers on ``t``'s device; key: a random int64.

    Returns:
        an int64 scalar on ``t``'s device (no host sync). A change made without knowing the key
        keeps it with negligible probability; knowing it, a change can be made to keep it
        (docs/design/engine.md, "State").
    """
    w = _words(t)
    n, width = w.numel(), words.numel()
    rows = n // width
    total = torch.zeros((), dtype=torch.int64, device=w.device)
    step = max(1, CHUNK_WORDS // width)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        x = w[start * width : stop * width].view(stop - start, width).to(torch.int64)
        index = torch.arange(start, stop, dtype=torch.int64, device=w.device)
        total += ((x * words).sum(1) * _mix(index + key)).sum()
    if rows * width < n:
        x = w[rows * width :].to(torch.int64)
        index = torch.full((), rows, dtype=torch.int64, device=w.device)
        total += (x * words[: x.numel()]).sum() * _mix(index + key)
    return total


def _device_checksum(device: torch.device) -> Callable[[Tensor, Tensor, int], Tensor]:
    """The keyed checksum to run on ``device``: the one-pass Triton kernel on CUDA where Triton
    is installed (equal bit for bit, :mod:`kiln.ops.kernels.keyed_checksum`), else
    :func:`keyed_checksum`."""
    from kiln.ops.kernels import runtime

    if device.type == "cuda" and runtime.has_triton() and not runtime.interpreting():
        from kiln.ops.kernels.keyed_checksum import keyed_checksum as one_pass

        return one_pass
    return keyed_checksum


def reference_tensors(
    models: Iterable[tuple[str, DecoderModel]], store: WeightStore
) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` of every tensor in ``store`` and every tensor param the ``models``'
    op sites bind, once each: a store tensor by its names (tied ones joined by `` = ``), any other
    as ``"<model label> <site>.<param>"``.
    """
    names: dict[int, list[str]] = {}
    tensors: dict[int, Tensor] = {}
    for name, t in store.items():
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    for label, model in models:
        for site in model.slots.sites():
            for param, value in site.params.items():
                if isinstance(value, Tensor) and id(value) not in tensors:
                    names[id(value)] = [f"{label} {site.name}.{param}"]
                    tensors[id(value)] = value
    return [(" = ".join(names[key]), t) for key, t in tensors.items()]


class StateGuard:
    """Digests of named tensors (module docstring), compared on demand.

    Args:
        tensors: ``(name, tensor)`` pairs, all on one device.
        keyed: use :func:`keyed_checksum` on the device (CUDA) instead of host SHA-256.
    """

    def __init__(self, tensors: Iterable[tuple[str, Tensor]], *, keyed: bool) -> None:
        pairs = list(tensors)
        self.names: tuple[str, ...] = tuple(name for name, _ in pairs)
        self.tensors: tuple[Tensor, ...] = tuple(t for _, t in pairs)
        self.keyed = keyed
        self._key: tuple[Tensor, int] | None = None
        self._baseline: tuple[object, ...] = ()
        self.begin()
        if not keyed:
            self._baseline = tuple(self._digests())

    def begin(self) -> None:
        """Keyed: draw a fresh key and record the content now under it (before a candidate
        loads); host digests are kept from construction (nothing to do).
        """
        if not self.keyed:
            return
        device = self.tensors[0].device if self.tensors else torch.device("cpu")
        raw = bytearray(secrets.token_bytes(8 * KEY_WORDS))
        words = torch.frombuffer(raw, dtype=torch.int64).to(device)
        self._key = (words, secrets.randbits(62))
        self._baseline = tuple(self._digests())

    def _digests(self) -> list[object]:
        if self.keyed:
            assert self._key is not None
            words, key = self._key
            checksum = _device_checksum(words.device)
            sums = [checksum(t, words, key + (i << 40)) for i, t in enumerate(self.tensors)]
            return torch.stack(sums).cpu().tolist() if sums else []
        return list(host_digests(self.tensors))

    def changes(self) -> list[str]:
        """Names of the tensors whose content differs from the recorded one."""
        now = self._digests()
        return [n for n, a, b in zip(self.names, now, self._baseline, strict=True) if a != b]

    def check(self, when: str) -> None:
        """Compare now.

        Raises:
            StateChanged: "state changed <when>: <name> differs from its content at build"
                (up to :data:`SHOWN` names; keyed: "before the candidate loaded").
        """
        changed = self.changes()
        if changed:
            since = "before the candidate loaded" if self.keyed else "at build"
            shown = ", ".join(changed[:SHOWN])
            if len(changed) > SHOWN:
                shown += f" (and {len(changed) - SHOWN} more)"
            verb = "differs from its" if len(changed) == 1 else "differ from their"
            raise StateChanged(f"state changed {when}: {shown} {verb} content {since}")
