"""The per-model search space against the engine's support statement, for every model config in
../shared/data/models, on the CPU target and a GPU one (h200).

- Configs kiln cannot build have no space: :func:`support_for` refuses them with the reason.
- Every single move from the reference in the per-model space (and a sample of its other
  points) is accepted by the statement the engine refuses candidates with; MoE spaces never hold
  ``fused_decode``; ``cuda_graph`` is never paired with a host-synchronising ``moe``.
- A tiny version of each buildable model (same structure: Q/K norms, GQA ratio, head_dim, tied
  embeddings, RoPE scaling, experts; small widths, 2 layers) actually runs every value of its
  CPU space through the engine's bind path (support check, rebind, transforms) and matches the
  reference; dense ones also run ``fused_decode`` (Triton's interpreter on CPU). What needs
  CUDA (``cuda_graph``, the Triton ops) is checked on the statement only.
- Proposals outside the space (an LLM's, any agent's) are dropped with a log line, never
  requested.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.agent_runner.agents.base import Agent, Proposal
from kiln.agent_runner.agents.llm import LLMAgent
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.config import LLMSettings
from kiln.agent_runner.llm.client import Completion
from kiln.agent_runner.results import ResultFeed
from kiln.agent_runner.space import (
    CUDA_GRAPH,
    FUSED_DECODE,
    OP_PREFIX,
    CandidateSpace,
    model_space,
    space_for,
)
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate, Transform
from kiln.ops.kernels import runtime
from kiln.runtime.support import ModelNotSupported, support_for
from kiln.runtime.transforms import RejectedCandidate, apply_transforms
from kiln.workloads.config import UnsupportedModelError, parse_config
from kiln.workloads.models import OpBinding, UnbuildableModelError, build_model

from .agent_board import result, view_of

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
CONFIGS = sorted(p.stem for p in MODELS.glob("*.json"))
HARDWARE = ("cpu", "h200")
FAST_FUSED = {  # values of the space's fused_decode parameters that keep the interpreter quick
    "qkv_block": "32",
    "o_block_n": "32",
    "gate_up_block_n": "32",
    "down_block_n": "32",
    "lm_block_n": "128",
    "block_k": "1024",
    "split_s": "512",
}


def _raw(name: str) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((MODELS / f"{name}.json").read_text())
    return raw


def _buildable(name: str) -> str | None:
    """None when kiln builds the model, else why not (parser or build check)."""
    try:
        from kiln.workloads.models.build import check_buildable

        check_buildable(parse_config(_raw(name), name))
    except (UnsupportedModelError, UnbuildableModelError) as exc:
        return str(exc)
    return None


BUILDABLE = [n for n in CONFIGS if _buildable(n) is None]
DENSE = [n for n in BUILDABLE if not parse_config(_raw(n), n).is_moe]


def _space(name: str, hardware: str) -> CandidateSpace:
    return model_space(space_for(hardware), _raw(name), hardware, name=name)


def test_the_shared_configs_are_all_here() -> None:
    assert len(CONFIGS) >= 12, CONFIGS
    assert {"llama-3.2-1b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b-v0.1"} <= set(BUILDABLE)
    assert "deepseek-v3" in BUILDABLE
    assert "minimax-m2.7" in BUILDABLE
    assert "gpt-oss-20b" in BUILDABLE
    assert "glm-5" in BUILDABLE


@pytest.mark.parametrize("name", sorted(set(CONFIGS) - set(BUILDABLE)))
def test_unbuildable_models_have_no_space(name: str) -> None:
    why = _buildable(name)
    assert why
    for hardware in HARDWARE:
        with pytest.raises(ModelNotSupported, match="no search space") as err:
            _space(name, hardware)
        assert why in str(err.value)


@pytest.mark.parametrize("hardware", HARDWARE)
@pytest.mark.parametrize("name", BUILDABLE)
def test_the_space_holds_nothing_its_engine_refuses(name: str, hardware: str) -> None:
    space = _space(name, hardware)
    support = space.support
    assert support is not None and support.device_type == ("cpu" if hardware == "cpu" else "cuda")
    moves = space.neighbours(REFERENCE_CANDIDATE)
    assert moves
    for dim, value, candidate in moves:
        assert support.refusal(candidate) is None, (dim, value)
    rng = random.Random(name)
    for _ in range(300):  # other points: several moves at once
        point = {d.name: rng.choice(d.values) for d in space.dims}
        candidate = space.candidate(point)
        if space.excluded(point) is None:
            assert support.refusal(candidate) is None, candidate.describe()
        else:  # what the space excludes, the engine refuses
            assert support.refusal(candidate) == space.excluded(point)
            assert not space.contains(candidate)
    hardware_dims = {d.name: d.values for d in space_for(hardware).dims}
    for d in space.dims:  # a restriction of the hardware space, never more
        assert set(d.values) <= set(hardware_dims[d.name])


@pytest.mark.parametrize("name", BUILDABLE)
def test_moe_models_get_fused_decode_and_unused_ops_are_gone(name: str) -> None:
    config = parse_config(_raw(name), name)
    gpu = {d.name for d in _space(name, "h200").dims}
    if config.mla is not None:  # no fused chain for latent attention; dense layers call mlp
        assert FUSED_DECODE not in gpu and not any(d.startswith(FUSED_DECODE) for d in gpu)
        assert "MLA" in (support_for(config, "cuda").transform_reason(FUSED_DECODE) or "")
        assert {OP_PREFIX + "moe", OP_PREFIX + "mlp", OP_PREFIX + "mla_attention"} <= gpu
        assert OP_PREFIX + "attention" not in gpu and OP_PREFIX + "qkv_proj" not in gpu
    elif config.model_type == "minimax_m2":  # partial rotary, per_layer Q/K norms: no chain
        assert FUSED_DECODE not in gpu and not any(d.startswith(FUSED_DECODE) for d in gpu)
        assert "per_layer" in (support_for(config, "cuda").transform_reason(FUSED_DECODE) or "")
        assert OP_PREFIX + "moe" in gpu and OP_PREFIX + "mlp" not in gpu
    elif config.model_type == "gpt_oss":  # sinks, windows, clamped SwiGLU: no fused chain
        assert FUSED_DECODE not in gpu and not any(d.startswith(FUSED_DECODE) for d in gpu)
        assert "sinks" in (support_for(config, "cuda").transform_reason(FUSED_DECODE) or "")
        assert not {OP_PREFIX + "moe", OP_PREFIX + "mlp"} & gpu
        # attention: the sink- and window-aware decode kernel, never sdpa (no sinks)
        values = {d.name: d.values for d in _space(name, "h200").dims}[OP_PREFIX + "attention"]
        assert "flash_decoding" in values and "sdpa" not in values
    elif config.is_moe:  # the fused chain runs expert layers through the bound moe op
        assert {FUSED_DECODE, FUSED_DECODE + ".block_k", OP_PREFIX + "moe"} <= gpu
        assert OP_PREFIX + "mlp" not in gpu  # every layer of these MoE configs routes
        assert support_for(config, "cuda").transform_reason(FUSED_DECODE) is None
    else:
        assert {FUSED_DECODE, FUSED_DECODE + ".block_k", OP_PREFIX + "mlp"} <= gpu
        assert OP_PREFIX + "moe" not in gpu and OP_PREFIX + "mla_attention" not in gpu
    assert CUDA_GRAPH in gpu and CUDA_GRAPH not in {d.name for d in _space(name, "cpu").dims}


def test_every_moe_implementation_pairs_with_cuda_graphs() -> None:
    """No built-in op implementation synchronises with the host: an MoE model's CUDA graph is a
    single move from the reference, with every moe implementation."""
    space = _space("qwen3-30b-a3b", "h200")
    assert space.exclusions == ()
    graph_alone = Candidate.make(transforms=[Transform.of("cuda_graph")])
    assert graph_alone in [c for _, _, c in space.neighbours(REFERENCE_CANDIDATE)]
    for impl in ("gathered", "dense"):
        graphed = Candidate.make({"moe": impl}, [Transform.of("cuda_graph")])
        assert space.refusal(graphed) is None


def test_an_implementation_registered_as_not_capturable_never_meets_cuda_graph() -> None:
    from kiln.ops.moe import reference
    from kiln.ops.registry import register, unregister

    register("moe", "host_loop", capturable=False)(reference)
    try:
        space = _space("qwen3-30b-a3b", "h200")
        assert {e.value for e in space.exclusions if e.transform == CUDA_GRAPH} == {"host_loop"}
        graphed = Candidate.make({"moe": "host_loop"}, [Transform.of("cuda_graph")])
        assert "synchronises with the host" in (space.refusal(graphed) or "")
        assert not space.contains(graphed)
    finally:
        unregister("moe", "host_loop")


def test_the_statement_says_why() -> None:
    llama = support_for(_raw("llama-3.2-1b"), "cpu", name="llama")
    assert llama.op_reason("moe", "gathered") == "op 'moe': llama never calls it (a dense model)"
    assert "runs on cuda only" in (llama.op_reason("attention", "flash_decoding") or "")
    assert llama.op_reason("attention", "sdpa") is None
    assert llama.op_reason("attention", "written_by_a_code_module") is None  # the engine judges
    assert llama.transform_reason("cuda_graph") == "transform 'cuda_graph' needs a CUDA engine"
    assert "CUDA" in (
        llama.transform_reason(Transform.of("torch_compile", mode="reduce-overhead")) or ""
    )
    assert llama.transform_reason("threads") is None
    gpu = support_for(_raw("llama-3.2-1b"), "cuda:0", name="llama")
    assert gpu.transform_reason("threads") is None  # not offered on GPUs, but not refused
    assert gpu.transform_reason(FUSED_DECODE) is None
    odd = {**_raw("qwen3-30b-a3b"), "moe_intermediate_size": 36}  # the reference falls back
    assert all(support_for(odd, "cpu").op_reason("moe", i) is None for i in ("gathered", "dense"))


# ---------------------------------------------------------------- tiny models on CPU


def _tiny(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` shrunk: 2 layers, hidden 64, one KV head with the same GQA ratio, same head_dim,
    Q/K norms, tied embeddings and RoPE scaling; 4 experts of width 32, top-2 (DeepSeek-V3: in
    2 groups, 1 kept; the first layer dense, the second MoE)."""
    heads, kv = raw["num_attention_heads"], raw.get("num_key_value_heads") or 1
    tiny = {**raw, "num_attention_heads": heads // kv, "num_key_value_heads": 1}
    tiny.update(hidden_size=64, intermediate_size=64, vocab_size=64, num_hidden_layers=2)
    tiny["head_dim"] = raw.get("head_dim") or raw["hidden_size"] // heads
    if tiny.get("rope_scaling"):
        tiny["rope_scaling"] = {**tiny["rope_scaling"], "original_max_position_embeddings": 16}
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if key in tiny:
            tiny.update({key: 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32})
    if "n_group" in tiny:
        tiny.update(n_group=2, topk_group=1, first_k_dense_replace=1)
    if "num_local_experts" in tiny:
        tiny["intermediate_size"] = 32
    if "layer_types" in tiny:  # gpt-oss: one entry per layer
        tiny["layer_types"] = tiny["layer_types"][:2]
    return tiny


@dataclass
class Tiny:
    """A tiny model's reference and measured copies over the same weights."""

    ref: Any
    model: Any
    tokens: torch.Tensor = field(
        default_factory=lambda: torch.randint(0, 64, (2, 6), generator=torch.Generator())
    )

    def check(self, candidate: Candidate, support: Any) -> None:
        """The engine's bind path for ``candidate``, a prefill and a decode step, against the
        reference; everything undone after."""
        assert support.refusal(candidate) is None
        self.model.rebind(OpBinding.from_recipe(dict(candidate.ops)))
        applied = apply_transforms(self.model, candidate.transforms, support)
        try:
            if applied.compiled:  # compiling takes seconds a model: accepted is enough here
                return
            for m in (self.ref, self.model):
                m.cache.reset()
                m.prefill(self.tokens)
            step = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(1))
            want, got = self.ref.decode_step(step), self.model.decode_step(step)
            assert (got - want).abs().max().item() < 1e-4, candidate.describe()
        finally:
            applied.revert()
            self.model.rebind(OpBinding.from_recipe())


def _build(name: str) -> Tiny:
    config = parse_config(_tiny(_raw(name)), name)
    ref = build_model(config, dtype=torch.float32, max_batch=2, max_seq_len=16)
    model = build_model(
        config, dtype=torch.float32, weights=ref.weights, max_batch=2, max_seq_len=16
    )
    return Tiny(ref, model)


@pytest.mark.parametrize("name", BUILDABLE)
def test_a_tiny_model_runs_every_value_of_its_cpu_space(name: str) -> None:
    tiny, space = _build(name), _space(name, "cpu")
    support = support_for(tiny.model.config, "cpu")
    values = [c for _, _, c in space.neighbours(REFERENCE_CANDIDATE)]
    assert values
    for candidate in values:
        tiny.check(candidate, support)
    gpu = support_for(tiny.model.config, "cuda")
    for _, _, c in _space(name, "h200").neighbours(REFERENCE_CANDIDATE):
        assert gpu.refusal(c) is None  # CUDA-only values: the statement
    graph = [Transform.of("cuda_graph")]
    with pytest.raises(RejectedCandidate) as err:
        apply_transforms(tiny.model, graph)
    assert str(err.value) == support.transform_reason("cuda_graph")


@pytest.mark.skipif(not runtime.can_run("cpu"), reason="needs Triton with TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", DENSE)
def test_a_tiny_dense_model_runs_fused_decode(name: str) -> None:
    tiny = _build(name)
    fused = Candidate.make(transforms=[Transform.of("fused_decode", **FAST_FUSED)])
    assert _space(name, "h200").contains(fused)
    tiny.check(fused, support_for(tiny.model.config, "cpu"))  # CPU: under the interpreter


def test_the_engine_refuses_with_the_statements_reason() -> None:
    from kiln.runtime.engine import Engine
    from kiln.runtime.request import RunRequest
    from kiln.runtime.spec import EngineLimits, EngineSpec

    from .engine_testing import tiny_workload

    raw = _tiny(_raw("qwen3-30b-a3b"))
    workload = tiny_workload(batch=2, context=8, name="tiny-qwen3-moe")
    workload["model"]["config_json"] = json.dumps(raw)
    limits = EngineLimits(max_batch=2, max_context=16, fast_layers=1, prompt_len=4, check_steps=1)
    engine = Engine(EngineSpec.from_workload(workload, "fast", limits))
    support = support_for(raw, "cpu", name="tiny-qwen3-moe")
    refused = [
        Candidate.make(transforms=[Transform.of("cuda_graph")]),
        Candidate.make({"mlp": "fused_gate_up"}),  # every layer is MoE
        Candidate.make({"attention": "flash_decoding"}),  # CUDA only
        Candidate.make(transforms=[Transform.of("torch_compile", mode="reduce-overhead")]),
    ]
    for candidate in refused:
        m = engine.run(RunRequest("exp", candidate, warmup=1, repeats=2))
        reason = support.refusal(candidate)
        assert reason and m.status == "rejected" and m.error == f"bind: {reason}", m.error
    ok = engine.run(RunRequest("exp", Candidate.make({"moe": "dense"}), repeats=2))
    assert ok.status == "ok", ok.error


# ---------------------------------------------------------------- agents


class FakeBoard:
    """Records claims and ideas; no history."""

    def __init__(self) -> None:
        self.claims: list[str] = []
        self.ideas: list[dict[str, Any]] = []

    async def claim(self, cid: str, candidate_id: str, agent: str, body: dict) -> bool:
        self.claims.append(candidate_id)
        return True

    async def post_idea(self, cid: str, candidate_id: str, agent: str, body: dict) -> None:
        self.ideas.append(body)

    async def history(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []


class FakeLab:
    """A compilation of ``name`` on ``hardware`` whose experiments are only recorded."""

    compilation_id = "c1"

    def __init__(self, name: str, hardware: str) -> None:
        self.space = _space(name, hardware)
        self.board = FakeBoard()
        self.results = ResultFeed(self.compilation_id)
        self.requested: list[Candidate] = []
        self.slots = 0

    async def acquire(self) -> bool:
        self.slots += 1
        return True

    def release(self) -> None:
        self.slots -= 1

    async def measure(self, candidate: Candidate, agent: str, *, profile: bool = False) -> None:
        self.requested.append(candidate)
        self.release()


class Fixed(Agent):
    """Proposes ``candidate`` once."""

    kind = "fixed"

    def __init__(self, candidate: Candidate) -> None:
        super().__init__("fixed", 0)
        self.candidate = candidate

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        return None if self.candidate.id in self.tried else Proposal(self.candidate, "test")


async def test_an_agent_proposal_outside_the_space_is_dropped_not_requested(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from kiln.ops.registry import implementations

    lab = FakeLab("qwen3-30b-a3b", "h200")  # every layer routes: the mlp op is never called
    mlp = next(i for i in implementations("mlp") if i != "reference")
    outside = Candidate.make({"mlp": mlp})
    agent = Fixed(outside)
    assert await agent._step(lab, view_of(), Proposal(outside, "test"))  # type: ignore[arg-type]
    assert lab.requested == [] and lab.board.claims == [] and lab.slots == 0
    assert outside.id in agent.tried
    inside = Candidate.make({"moe": "dense"}, [Transform.of("cuda_graph")])
    assert await agent._step(lab, view_of(), Proposal(inside, "test"))  # type: ignore[arg-type]
    assert lab.requested == [inside]


class ScriptedClient:
    """Answers with ``replies`` in order; counts the requests."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)
        self.asked = 0

    async def complete(self, messages: list[dict[str, str]]) -> Completion:
        self.asked += 1
        return Completion(self.replies.pop(0), "scripted", "stop")

    async def close(self) -> None:
        pass


def _module(impl: str, devices: str = "") -> str:
    extra = f", devices={devices}" if devices else ""
    return (
        "```python\nimport torch\nfrom kiln.ops.registry import register\n\n"
        f'@register("attention", "{impl}"{extra})\n'
        f"def {impl}(q, k_cache, v_cache, positions, seq_lens, *, scale):\n"
        "    return q\n```\n"
    )


def _llm(name: str, client: ScriptedClient) -> LLMAgent:
    settings = LLMSettings(url="http://127.0.0.1:9/v1", max_bad_replies=2)
    agent = LLMAgent(name, 1, settings, client=client)  # type: ignore[arg-type]
    agent.pick_op = lambda targets, op_ms: "attention"  # type: ignore[method-assign]
    return agent


async def test_llm_proposals_the_engine_would_refuse_are_dropped_before_requested() -> None:
    lab = FakeLab("llama-3.2-1b", "cpu")
    # the board's best so far swaps an op this dense model never calls: whatever the LLM
    # writes on top of it is refused, reply after reply, until the agent gives up
    odd_base = Candidate.make({"moe": "gathered"})
    view = view_of(result(odd_base, 200.0), result(REFERENCE_CANDIDATE, 100.0))
    client = ScriptedClient(_module("llm_a"), _module("llm_b"))
    agent = _llm("llm", client)
    assert await agent.next_proposal(view, lab) is None
    assert client.asked == 2 and agent.stopped
    reasons = [i["reason"] for i in lab.board.ideas]
    assert len(reasons) == 2 and all("never calls it" in r for r in reasons), reasons
    assert lab.requested == [] and lab.board.claims == []

    # a module registered for CUDA only, on a CPU compilation: dropped; the next one is fine
    cuda_only = ScriptedClient(_module("llm_c", '("cuda",)'), _module("llm_d"))
    agent = _llm("llm-2", cuda_only)
    proposal = await agent.next_proposal(view_of(result(REFERENCE_CANDIDATE, 100.0)), lab)
    assert cuda_only.asked == 2 and agent.bad_in_row == 0
    assert proposal is not None and dict(proposal.candidate.ops) == {"attention": "llm_d"}
    assert "registered for cuda only" in lab.board.ideas[-1]["reason"]
    assert lab.requested == []
