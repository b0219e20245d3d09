"""The red team's later kinds play real tricks: each cheat's code module loaded on its own (as
a naive harness would) does what its description says to the engine's own parts — the output
reservoir and copy, the comparison, the fingerprint, the dispatcher watch — with no engine
around. ``tests/unit/test_red_team.py`` runs them through the engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.ops import registry
from kiln.runtime.check import PLAIN, NotPlainTensor, TimedOutputs, compare
from kiln.runtime.dispatch_watch import DispatchTables
from kiln.runtime.integrity import HarnessFingerprint
from kiln.workloads.models.decoder import DecoderModel
from tests.red_team import cheats as red_team

from .red_team_testing import loaded_alone

X = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
W = torch.randn(4096, 128, generator=torch.Generator().manual_seed(1))


def _cheat(name: str) -> red_team.Cheat:
    (cheat,) = [c for c in red_team.CHEATS if c.name == name]
    return cheat


def _naive_copy(out: torch.Tensor) -> torch.Tensor:
    """What a naive harness does with a timed step's output, outside the timed interval."""
    return out.detach().float().clone()


def _engine_refuses(out: object) -> None:
    """The engine's path for a timed step's output refuses anything but a plain tensor
    (exact types), before running any of its code."""
    with pytest.raises(NotPlainTensor, match=PLAIN):
        TimedOutputs(1).offer(0, out)


@pytest.mark.parametrize(
    ("name", "impl"), [("lazy_logits", "lazy"), ("lazy_dispatch", "deferred_dispatch")]
)
def test_lazy_logits_are_computed_only_when_the_engine_copies_them(name: str, impl: str) -> None:
    with loaded_alone(_cheat(name)) as cheat:
        out = registry.get("lm_head", impl).fn(X, weight=W)
        assert isinstance(out, torch.Tensor) and type(out) is not torch.Tensor
        assert cheat._computed == []  # the call returned with nothing computed
        _engine_refuses(out)
        assert cheat._computed == []
        logits = _naive_copy(out)
        assert cheat._computed == [1]  # a naive copy ran the LM head, after the clock
        assert type(logits) is torch.Tensor
        torch.testing.assert_close(logits, F.linear(X, W), rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "impl"), [("answering_tensor", "agreeable"), ("dunder_answers", "dunder")]
)
def test_agreeable_zeros_pass_the_engines_comparison(name: str, impl: str) -> None:
    reference = F.linear(X, W)
    with loaded_alone(_cheat(name)):
        out = registry.get("lm_head", impl).fn(X, weight=W)
        assert int(torch.count_nonzero(out)) == 0
        assert bool(((out - reference).abs() <= 1e-3).all())  # a naive comparison: "equal"
        _engine_refuses(out)
    assert not compare([torch.zeros_like(reference)], [reference], 1e-3).correct


@pytest.mark.parametrize(
    ("name", "kept_step"),
    [("system_random_rebind", 0), ("randrange_patch", 0), ("urandom_rebind", 5)],
)
def test_the_verified_step_is_the_one_the_cheat_picks(name: str, kept_step: int) -> None:
    with loaded_alone(_cheat(name)):
        for _ in range(20):
            kept = TimedOutputs(1)
            for step in range(6):
                copy = kept.offer(step, torch.zeros(1, 2))
                if copy is not None:
                    copy()
            assert [step for step, _ in kept.kept()] == [kept_step]


@pytest.mark.parametrize("name", ["identity_blind", "all_blind"])
def test_a_blinded_fingerprint_sees_the_reference_patched(name: str) -> None:
    fingerprint = HarnessFingerprint.take()
    layer = DecoderModel._layer
    with loaded_alone(_cheat(name)):
        assert DecoderModel._layer is not layer
        assert fingerprint.changes() == []
    assert DecoderModel._layer is layer


def test_a_blinded_dispatcher_watch_sees_matmuls_zeroed() -> None:
    tables = DispatchTables.take()
    ones = torch.ones(2, 2)
    with loaded_alone(_cheat("dispatch_dump_blind")):
        assert bool((ones @ ones).eq(0).all())
        assert tables.changes() == []
    assert tables.changes() == [] and bool((ones @ ones).eq(2).all())
