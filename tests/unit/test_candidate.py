"""Candidates are content-addressed: same content, same id."""

from __future__ import annotations

import pytest

from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, CodeModule, Transform


def test_same_content_same_id_regardless_of_order_and_reference_entries() -> None:
    a = Candidate.make(
        {"attention": "sdpa", "mlp": "fused_gate_up", "rms_norm": "reference"},
        [Transform.of("threads", n=2), Transform.of("torch_compile", mode="default")],
    )
    b = Candidate.make(
        {"mlp": "fused_gate_up", "attention": "sdpa"},
        [Transform.of("torch_compile", mode="default"), Transform.of("threads", n="2")],
    )
    assert a.id == b.id and a == b
    assert len(a.id) == 24


def test_different_content_different_id() -> None:
    base = Candidate.make({"attention": "sdpa"})
    assert base.id != Candidate.make({"attention": "reference"}).id
    assert base.id != Candidate.make({"attention": "sdpa"}, lossy=True).id
    assert base.id != Candidate.make({"attention": "sdpa"}, [Transform.of("threads", n=1)]).id
    code = Candidate.make(code_modules=[CodeModule("m", "x = 1")])
    assert code.id != Candidate.make(code_modules=[CodeModule("m", "x = 2")]).id


def test_reference_candidate() -> None:
    assert REFERENCE_CANDIDATE.is_reference
    assert Candidate.make({"attention": "reference"}) == REFERENCE_CANDIDATE
    assert REFERENCE_CANDIDATE.describe() == "reference"


def test_round_trips_through_canonical_json_and_proto() -> None:
    c = Candidate.make(
        {"qkv_proj": "fused"},
        [Transform.of("torch_compile", mode="max-autotune")],
        [CodeModule("k", "pass")],
    )
    assert Candidate.from_canonical(c.canonical()) == c
    msg = c.to_proto()
    assert msg.candidate_id == c.id
    assert Candidate.from_proto(msg) == c
    assert c.describe() == "qkv_proj=fused, torch_compile(mode=max-autotune), code:k"


def test_a_transform_twice_is_rejected() -> None:
    with pytest.raises(ValueError, match="appears twice"):
        Candidate.make(transforms=[Transform.of("threads", n=1), Transform.of("threads", n=2)])
