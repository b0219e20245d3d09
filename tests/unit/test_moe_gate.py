"""The routing-aware gate on CPU MoE engines, per family kiln builds (Qwen3-MoE with and without
top-k renormalisation, Mixtral) in float32 and bfloat16: the library's ``moe`` implementations
(alone and with ``attention=sdpa``) and honest routers that differ only within rounding of a tie
pass; every wrong candidate of :mod:`tests.red_team.moe` fails, and still fails on the
per-layer check alone with nothing compared end to end; without the undetermined-position
handling some honest candidate fails on these configs (they do have near ties); on a deep
bfloat16 model, where hardly any row is compared end to end, the per-layer check catches the
wrong ones; a candidate that changes the recorded inputs fails.

The configs are the families' shapes, small, with ``initializer_range`` 0.1 so that the seeded
routers are far from uniform (a trained router is): with the default 0.02 the top-k weights are
nearly equal, and a uniform-weights candidate was only 10 % past the bfloat16 tolerance.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kiln.domain.candidate import Candidate, Transform
from kiln.ops.kernels import runtime
from kiln.runtime import moe_check
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from tests.red_team import moe as red_team_moe

from .engine_testing import module, tiny_workload

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
}
QWEN3 = {
    **COMMON,
    "model_type": "qwen3_moe",
    "head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "mlp_only_layers": [1],
    "rms_norm_eps": 1e-6,
}
FAMILIES: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B's routing (many experts, top-8, renormalised): frequent bfloat16 ties
    "qwen3_moe": {**QWEN3, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": True},
    "qwen3_moe-nonorm": {
        **QWEN3,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
    },
    "mixtral": {
        **COMMON,
        "model_type": "mixtral",
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
    },
}
DTYPES = ["float32", "bfloat16"]
LIMITS = EngineLimits(max_batch=8, max_context=32, prompt_len=8, check_steps=2, check_batch=4)
SEEDS = (0, 1, 2)
LIBRARY = {
    "reference": {},
    "gathered": {"moe": "gathered"},
    "dense": {"moe": "dense"},
    "sdpa": {"attention": "sdpa"},
    "dense+sdpa": {"moe": "dense", "attention": "sdpa"},
}
FUSED = ("fused_decode+dense",)
"""Library candidates with the fused decode chain (Triton's interpreter on CPU)."""


def library(recipe: str) -> Candidate:
    """One of :data:`FUSED` as a candidate."""
    ops = {"moe": "dense"} if recipe.endswith("+dense") else {}
    return Candidate.make(ops, [Transform.of("fused_decode")])


_engines: dict[tuple[str, str, bool], Engine] = {}


def build(config: dict[str, Any], dtype: str, *, sandbox: bool = True) -> Engine:
    workload = tiny_workload(batch=8, context=24, dtype=dtype, name=config["model_type"])
    workload["model"]["config_json"] = json.dumps(config)
    spec = EngineSpec.from_workload(workload, "full", LIMITS)
    return Engine(spec, engine_id="moe-gate", sandbox=sandbox)


def engine(family: str, dtype: str, *, sandbox: bool = True) -> Engine:
    if (family, dtype, sandbox) not in _engines:
        _engines[family, dtype, sandbox] = build(FAMILIES[family], dtype, sandbox=sandbox)
    return _engines[family, dtype, sandbox]


@pytest.fixture(scope="module", autouse=True)
def _drop_engines() -> Iterator[None]:
    yield
    _engines.clear()


def run(e: Engine, candidate: Candidate, seed: int = 0) -> Measurement:
    return e.run(RunRequest("moe-gate", candidate, warmup=1, repeats=3, seed=seed))


def honest(family: str) -> list[red_team_moe.MoECase]:
    cfg = engine(family, "float32").model.config.moe
    assert cfg is not None
    return red_team_moe.cases(cfg, honest=True)


def wrong(family: str) -> list[red_team_moe.MoECase]:
    cfg = engine(family, "float32").model.config.moe
    assert cfg is not None
    return red_team_moe.cases(cfg)


@pytest.mark.parametrize("recipe", list(LIBRARY))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_library_implementations_pass(family: str, dtype: str, recipe: str) -> None:
    e = engine(family, dtype)
    for seed in SEEDS:
        m = run(e, Candidate.make(LIBRARY[recipe]), seed)
        assert m.status == "ok", (seed, m.error)
        assert any(n.startswith("moe: per-layer check") for n in m.notes), m.notes


@pytest.mark.skipif(not runtime.can_run("cpu"), reason="needs Triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("recipe", FUSED)
def test_fused_decode_on_expert_layers_passes(recipe: str) -> None:
    """The fused chain with the bound moe op, on the family with the most bfloat16 near-ties
    (one seed: the interpreter runs every Triton program in Python)."""
    m = run(engine("qwen3_moe", "bfloat16"), library(recipe))
    assert m.status == "ok", m.error
    assert any(n.startswith("moe: per-layer check") for n in m.notes), m.notes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_honest_routers_pass(family: str, dtype: str) -> None:
    e = engine(family, dtype)
    for case in honest(family):
        for seed in SEEDS:
            m = run(e, case.candidate, seed)
            assert m.status == "ok", (case.name, seed, m.error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_wrong_implementations_fail(family: str, dtype: str) -> None:
    e = engine(family, dtype)
    cases = wrong(family)
    names = {c.name for c in cases}
    assert {"lowest_k", "off_by_one", "uniform_weights", "capacity_drop"} <= names
    assert ("no_renorm" in names) != ("extra_renorm" in names)
    for case in cases:
        for seed in SEEDS[:2]:
            m = run(e, case.candidate, seed)
            assert m.status == "incorrect", (case.name, seed, m.status, m.error)
            assert not m.restart_engine
    assert run(e, Candidate()).status == "ok"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_per_layer_check_alone_catches_every_wrong_candidate(
    family: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no row compared end to end (as on a deep bfloat16 model), each wrong candidate still
    fails, on the per-layer check; the honest ones still pass."""
    rows = moe_check.RoutedCheck.rows

    def nothing_end_to_end(self: moe_check.RoutedCheck, view: Any) -> Any:
        kept = rows(self, view)
        return None if kept is None else [torch.zeros_like(r) for r in kept]

    monkeypatch.setattr(moe_check.RoutedCheck, "rows", nothing_end_to_end)
    e = engine(family, dtype)
    for case in wrong(family):
        m = run(e, case.candidate)
        assert m.status == "incorrect" and "per-layer check" in m.error, (case.name, m.error)
    for case in honest(family):
        assert run(e, case.candidate).status == "ok", case.name


def _everything_determined(r: moe_check.Routing, drift: float = 0.0) -> torch.Tensor:
    return torch.ones(r.scores.shape[0], dtype=torch.bool, device=r.scores.device)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_without_the_tie_handling_an_honest_candidate_fails(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """These configs have near ties in bfloat16: with every route taken as determined (no
    position excluded, every row compared), some correct candidate is judged incorrect."""
    e = engine(family, "bfloat16")
    monkeypatch.setattr(moe_check, "determined", _everything_determined)
    candidates = [c.candidate for c in honest(family)]
    candidates += [Candidate.make(LIBRARY[r]) for r in ("sdpa", "dense+sdpa")]
    verdicts = [run(e, c, seed).status for c in candidates for seed in SEEDS]
    assert "incorrect" in verdicts, verdicts
    monkeypatch.undo()
    assert all(run(e, c, seed).status == "ok" for c in candidates for seed in SEEDS)


def test_deep_bfloat16_the_per_layer_check_catches_what_end_to_end_cannot() -> None:
    """Eight expert layers of 64 experts top-8 in bfloat16: nearly every row has a route near a
    tie somewhere, so hardly any is compared end to end; every wrong candidate still fails, on
    the per-layer check."""
    deep = {**FAMILIES["qwen3_moe"], "num_hidden_layers": 8, "mlp_only_layers": []}
    e = build(deep, "bfloat16")
    ok = run(e, Candidate.make({"moe": "dense", "attention": "sdpa"}))
    assert ok.status == "ok", ok.error
    (note,) = [n for n in ok.notes if n.startswith("moe: per-layer check")]
    compared, total = (int(v) for v in note.split("end to end ")[1].split(" rows")[0].split(" of "))
    assert compared <= total // 4, note
    for case in wrong("qwen3_moe"):
        m = run(e, case.candidate)
        assert m.status == "incorrect" and "per-layer check" in m.error, (case.name, m.error)


TAMPER = module(
    "tamper_recorded",
    """
import gc
import sys
from kiln.ops.moe import reference


def _per_layer_check():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "check_layers":
            return True
        frame = frame.f_back
    return False


@register("moe", "tamper", replace=True)
def tamper(x, **params):
    # Honest, except under the per-layer check: there it zeroes every other tensor of its
    # input's shape (the recorded input among them, so the reference's answer becomes 0) and
    # returns zeros.
    if not _per_layer_check():
        return reference(x, **params)
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj is not x and obj.shape == x.shape:
            obj.zero_()
    return torch.zeros_like(x)
""",
)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc also finds torch's deprecated objects
def test_a_candidate_that_changes_the_recorded_inputs_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # in process (what the recorded-input checksum guards; a sandboxed candidate gets a copy)
    e = engine("qwen3_moe", "bfloat16", sandbox=False)
    cheat = Candidate.make({"moe": "tamper"}, code_modules=[TAMPER])
    m = run(e, cheat)
    assert m.status == "incorrect", m.error
    assert "recorded input or mask changed while the candidate's op ran" in m.error, m.error
    assert run(e, Candidate()).status == "ok"
    # the checksum is what catches it: without it the reference agrees with the zeros
    monkeypatch.setattr(moe_check._Call, "intact", lambda self: True)
    assert run(e, cheat).status == "ok"
