"""One red-team cheat (:class:`Cheat`) and the strings the engine's verdicts contain."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.domain.candidate import Candidate, CodeModule

VERIFIED = "(verified after timing)"
"""In the error when a kept timed step's output differed from the reference's."""
OUTSIDE = "work outside the timed call"
"""In the error when a thread kept running candidate code after a timed call returned."""
TAMPERED = "changed the engine outside its ops"
"""In the error when the engine's code, models or numerics flags were changed."""
AT_SHAPE = "at batch "
"""In the error when the checked step at the traffic shape differed from the reference's."""
STATE = "state changed"
"""In the error when a tensor the reference read (a weight) differs from its content at build."""
JUDGED = "(judged outside the candidate's sandbox)"
"""In the error when a sandboxed candidate's outputs differed from the judge's reference (the
process split: nothing the candidate runs reaches the reference, the comparison or its inputs)."""
SANDBOX_STATE = "state changed in the sandbox"
"""In the error when a sandboxed candidate wrote its (copy-on-write) copy of the weights."""

KINDS = {
    "a": "cached outputs",
    "b": "skipped work",
    "c": "a fraction of the batch",
    "d": "the reference's result or the reference itself",
    "e": "work outside the timed region, or a fooled clock",
    "f": "outputs that are not plain tensors",
    "g": "information the candidate should not have",
    "h": "the timing statistic",
    "i": "the watches themselves",
    "j": "state shared with the reference (weights, KV cache)",
    "k": "a fraction of the timed steps",
    "l": "undeclared lossy arithmetic",
}
"""Kind letter -> what the cheat goes after."""

DEFENSES = (
    "process split",
    "exact types",
    "timing statistic",
    "more verified steps",
    "float64-derived tolerance",
)
"""The defenses an escaping cheat may name (:attr:`Cheat.escapes` starts with one)."""


@dataclass(frozen=True)
class Cheat:
    """One cheating candidate and the verdict it must get.

    Attributes:
        name: short id (test ids, reports).
        kind: a letter of :data:`KINDS`.
        how: the trick and why a naive harness passes it, in words.
        candidate: the candidate (ops and code modules).
        caught: substrings the measurement's error must all contain (status INCORRECT).
        devices: device types the cheat applies to (``"cpu"``, ``"cuda"``).
        escapes: "" when the engine rejects it today; else the defense it needs (one of
            :data:`DEFENSES`, then why), and the test expects it to come back ``ok``.
        runs: experiments in a row that must all be INCORRECT (a cheat that escapes by chance,
            or one that prepares the next experiment).
        dtype: the engine's dtype it is run on (``float32`` or ``bfloat16``).
        timed_steps: timed decode steps per experiment (more than the verified steps where the
            trick steers which step is verified).
        sandboxed: what a sandboxed engine's error must contain (default: :data:`JUDGED`);
            ``caught`` is the in-process engine's (``Engine(sandbox=False)``).
        disarmed: "" unless, in the sandbox, the trick finds nothing to use and the candidate
            computes honestly: then why (naming the defense); it must come back ``ok`` without
            having played (``_played`` empty).
        needs: "" unless the trick needs something of the hardware (e.g. bfloat16 matmuls for
            float32); where that is missing it records no play and computes honestly, so ``ok``
            without having played is accepted.
    """

    name: str
    kind: str
    how: str
    candidate: Candidate
    caught: tuple[str, ...]
    devices: tuple[str, ...] = ("cpu", "cuda")
    escapes: str = ""
    runs: int = 1
    dtype: str = "float32"
    timed_steps: int = 4
    sandboxed: tuple[str, ...] = (JUDGED,)
    disarmed: str = ""
    needs: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: unknown kind {self.kind!r}")
        if self.escapes and not self.escapes.startswith(DEFENSES):
            raise ValueError(f"{self.name}: escapes must name a defense of {DEFENSES}")
        if not (self.escapes or self.caught or self.sandboxed or self.disarmed):
            raise ValueError(f"{self.name}: a cheat rejected today says by what (caught)")


def make(
    name: str,
    kind: str,
    how: str,
    ops: dict[str, str],
    module: CodeModule,
    caught: tuple[str, ...] = (),
    **more: object,
) -> Cheat:
    """A :class:`Cheat` whose candidate is ``ops`` with the one code module ``module``."""
    return Cheat(
        name,
        kind,
        how,
        Candidate.make(ops, code_modules=[module]),
        caught,
        **more,  # type: ignore[arg-type]
    )
