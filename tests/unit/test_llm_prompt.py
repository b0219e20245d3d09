"""The code-writing agent's prompt, board history and target choice (no network)."""

from __future__ import annotations

import inspect

import pytest

import kiln.ops  # noqa: F401  (registers the built-in implementations)
from kiln.agent_runner.agents.llm import LLMAgent, target_ops, with_module, workload_facts
from kiln.agent_runner.config import LLMSettings
from kiln.agent_runner.llm import WorkloadFacts, build_messages
from kiln.agent_runner.llm.history import history_text, op_profile, read_op_ms
from kiln.agent_runner.llm.parse import ParsedModule
from kiln.agent_runner.results import result_body
from kiln.agent_runner.space import space_for
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, CodeModule, Transform
from kiln.ops import registry
from kiln.ops import rms_norm as rms_norm_module
from kiln.v1 import common_pb2

FACTS = WorkloadFacts(hardware="h200", model="llama-3.2-1b", batch=8, context=2048, dtype="bf16")


def _body(c: Candidate, tps: float, status: str = "ok", error: str = "", **extra: object) -> dict:
    summary = {"status": status, "correct": status == "ok", "tokens_per_s": tps, "error": error}
    return {**result_body(c, summary, tps / 100.0 if status == "ok" else None), **extra}


FAST = Candidate.make({"rms_norm": "fused_residual"}, [Transform.of("cuda_graph")])
BROKEN = Candidate.make({"attention": "llm_x"}, code_modules=[CodeModule("llm_attention_1", "")])
RESULTS = [
    _body(REFERENCE_CANDIDATE, 100.0, op_ms={"rms_norm": 2.0, "mlp": 6.0}),
    _body(BROKEN, 0.0, status="incorrect", error="max abs error 3.1 > tolerance 0.02"),
    _body(FAST, 150.0),
]


def test_messages_carry_contract_reference_source_history_facts_and_profile() -> None:
    system, user = build_messages("rms_norm", facts=FACTS, results=RESULTS, notes=["no code"])
    assert system["role"] == "system" and user["role"] == "user"
    s, u = system["content"], user["content"]
    assert '@register("rms_norm", "<name>", replace=True)' in s
    assert "reference, fused_residual" in s  # taken names (Triton-backed ones too)
    assert "Import only kiln.ops, math, torch, typing." in s  # no triton in the allow-list
    assert "single ```python fenced block" in s
    assert registry.OPS["rms_norm"] in u
    assert inspect.getsource(registry.get("rms_norm").fn) in u
    assert (rms_norm_module.__doc__ or "").strip().splitlines()[0] in u  # module docstring
    assert "hardware h200; model llama-3.2-1b (bf16); decode batch 8; context 2048 tokens" in u
    assert "2 ms per forward step (25.0% of the 8 ms of all ops)" in u
    # History: correct results fastest first, then failures with their errors, then notes.
    fast_at = u.index("[ok] 150 tokens/s, 1.5x baseline: rms_norm=fused_residual, cuda_graph")
    ref_at = u.index("[ok] 100 tokens/s, 1x baseline: reference")
    bad_at = u.index("[incorrect] 0 tokens/s: attention=llm_x, code:llm_attention_1")
    assert fast_at < ref_at < bad_at < u.index("[your reply rejected] no code")
    assert "error: max abs error 3.1 > tolerance 0.02" in u


def test_triton_is_offered_only_when_allowed() -> None:
    system, _ = build_messages("mlp", facts=FACTS, triton=True)
    assert "Import only kiln.ops, math, torch, triton, typing." in system["content"]


def test_without_results_or_profile() -> None:
    _, user = build_messages("mlp", facts=WorkloadFacts())
    assert "(no results yet)" in user["content"]
    assert "Measured time of mlp: not measured yet" in user["content"]
    assert "hardware unknown; model unknown" in user["content"]


def test_unknown_op_is_refused() -> None:
    with pytest.raises(registry.UnknownOpError):
        build_messages("nope", facts=FACTS)


def test_history_is_cut_to_its_budget_keeping_the_best() -> None:
    many = [_body(Candidate.make({"mlp": f"impl{i}"}), 100.0 + i) for i in range(200)]
    text = history_text(many, 1000)
    assert len(text) <= 1000
    lines = text.splitlines()
    assert "mlp=impl199" in lines[0]  # the fastest first
    assert lines[-1].startswith("... (") and lines[-1].endswith("more left out)")
    assert len(lines) - 1 + int(lines[-1].split("(")[1].split()[0]) == 200
    assert "more left out" not in history_text(many[:3], 1000)
    _, user = build_messages("mlp", facts=FACTS, results=many, history_chars=800)
    assert "more left out" in user["content"] and "impl199" in user["content"]
    assert "impl100" not in user["content"]


def test_long_errors_are_excerpted() -> None:
    text = history_text([_body(BROKEN, 0.0, status="crashed", error="E" * 5000)], 6000)
    assert "E" * 240 + "..." in text and "E" * 241 not in text


def test_op_profile_reads_op_ms_defensively() -> None:
    assert op_profile(RESULTS) == {"rms_norm": 2.0, "mlp": 6.0}
    assert op_profile([_body(FAST, 1.0)]) == {}
    assert read_op_ms({"op_ms": "junk"}) == {}
    assert read_op_ms({"op_ms": {"mlp": "x", "rms_norm": -1, "rope": float("nan"), "a": 1}}) == {
        "a": 1.0
    }
    # The fastest correct result's profile wins over an older one.
    newer = _body(FAST, 150.0, op_ms={"mlp": 1.0})
    assert op_profile([*RESULTS[:2], newer]) == {"mlp": 1.0}


def _agent() -> LLMAgent:
    return LLMAgent("llm", 1, LLMSettings(url="http://127.0.0.1:9/v1"))


def test_target_ops_round_robin_without_a_profile_and_by_time_with_one() -> None:
    agent = _agent()
    targets = target_ops(space_for("cpu", cpus=2))
    assert "rms_norm" in targets and "mlp" in targets
    picked = []
    for _ in range(len(targets)):
        op = agent.pick_op(targets, {})
        agent._attempts[op] += 1
        picked.append(op)
    assert picked == targets
    agent = _agent()
    profile = {"rms_norm": 2.0, "mlp": 6.0}
    picked = []
    for _ in range(4):
        op = agent.pick_op(targets, profile)
        agent._attempts[op] += 1
        picked.append(op)
    # mlp (6 ms) twice before rms_norm (2 ms): 6/1, 6/2=3 > 2, then 6/3=2 ties -> space order.
    assert picked[:2] == ["mlp", "mlp"] and "rms_norm" in picked[2:]


def test_with_module_builds_on_the_base_and_replaces_an_earlier_module_of_the_op() -> None:
    old = CodeModule("llm_rms_norm_aaaaaaaa", "old")
    keep = CodeModule("llm_mlp_bbbbbbbb", "mlp")
    base = Candidate.make(
        {"rms_norm": "llm_old", "mlp": "llm_m"}, [Transform.of("cuda_graph")], [old, keep]
    )
    new = CodeModule("llm_rms_norm_cccccccc", "new")
    c = with_module(base, ParsedModule("rms_norm", "llm_new", new, ""))
    assert dict(c.ops) == {"rms_norm": "llm_new", "mlp": "llm_m"}
    assert c.transforms == base.transforms and c.code_modules == (keep, new)


def test_workload_facts_from_the_lab() -> None:
    workload = common_pb2.Workload(
        model=common_pb2.ModelSpec(name="tiny", dtype="float32"),
        traffic=common_pb2.TrafficShape(batch_size=4, context_len=512),
        hardware=common_pb2.HardwareTarget(name="cpu"),
    )

    class State:
        pass

    class Lab:
        state = State()

    Lab.state.workload = workload  # type: ignore[attr-defined]
    assert workload_facts(Lab()) == WorkloadFacts("cpu", "tiny", 4, 512, "float32")
    assert workload_facts(object()) == WorkloadFacts()
