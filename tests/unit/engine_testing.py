"""Shared helpers for the engine pool tests: a tiny Llama workload, candidates, work items."""

from __future__ import annotations

import json
import uuid
from typing import Any

from kiln.common.work import ExperimentWork
from kiln.domain.candidate import Candidate, CodeModule
from kiln.engine_pool.job import Job
from kiln.engine_pool.settings import EngineSettings

# The Llama-3.2-1B config shrunk: same architecture (GQA, llama3 RoPE, tied embeddings).
TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 128,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def tiny_workload(
    *, batch: int = 3, context: int = 40, dtype: str = "float32", name: str = "tiny-llama"
) -> dict[str, Any]:
    """A ``kiln.v1.Workload`` as JSON (what ExperimentWork carries) over :data:`TINY_LLAMA`;
    ``dtype=""`` leaves ``model.dtype`` unset (the engine picks)."""
    model: dict[str, Any] = {"name": name, "config_json": json.dumps(TINY_LLAMA), "seed": "7"}
    if dtype:
        model["dtype"] = dtype
    return {
        "model": model,
        "traffic": {"source": "synthetic", "batch_size": batch, "context_len": context},
        "hardware": {"name": "cpu", "num_devices": 1},
    }


def engine_settings(**overrides: Any) -> EngineSettings:
    """Settings for quick tests: few timed steps, no queue."""
    values: dict[str, Any] = {"warmup": 1, "repeats": 3, "consume": False}
    values.update(overrides)
    return EngineSettings(**values)


def work(
    candidate: Candidate,
    *,
    deadline_s: float = 60.0,
    tier: str = "fast",
    workload: dict[str, Any] | None = None,
    experiment_id: str | None = None,
    team: str = "search",
) -> ExperimentWork:
    """An ExperimentWork for ``candidate`` on the tiny workload."""
    return ExperimentWork(
        experiment_id=experiment_id or uuid.uuid4().hex,
        compilation_id="cmp-test",
        team=team,
        tier=tier,  # type: ignore[arg-type]
        candidate=candidate.canonical(),
        workload=workload or tiny_workload(),
        deadline_s=deadline_s,
    )


def job(candidate: Candidate, **kwargs: Any) -> Job:
    """:func:`work` (same arguments) as the pool runs it."""
    return Job(work(candidate, **kwargs), candidate)


def module(name: str, source: str) -> CodeModule:
    """A code module importing what op modules usually need."""
    header = "import os\nimport time\nimport torch\nfrom kiln.ops.registry import register\n"
    return CodeModule(name, header + source)


ZEROS_ATTENTION = module(
    "zeros",
    """
@register("attention", "zeros", replace=True)
def zeros(q, k_cache, v_cache, positions, seq_lens, *, scale):
    return torch.zeros_like(q)
""",
)

RAISING_MLP = module(
    "boom",
    """
@register("mlp", "boom", replace=True)
def boom(x, *, gate_weight, up_weight, down_weight):
    raise RuntimeError("kaboom from a candidate")
""",
)

# A correct alternative defined by a code module: SiLU-gated MLP written out by hand.
HANDWRITTEN_MLP = module(
    "handwritten_mlp",
    """
@register("mlp", "handwritten", replace=True)
def handwritten(x, *, gate_weight, up_weight, down_weight):
    gate = x @ gate_weight.T
    return ((gate * torch.sigmoid(gate)) * (x @ up_weight.T)) @ down_weight.T
""",
)

EXIT_AT_LOAD = module("exit3", "os._exit(3)\n")

SLEEPY_ATTENTION = module(
    "sleepy",
    """
from kiln.ops.attention import reference

@register("attention", "sleepy", replace=True)
def sleepy(q, k_cache, v_cache, positions, seq_lens, *, scale):
    time.sleep(60)
    return reference(q, k_cache, v_cache, positions, seq_lens, scale=scale)
""",
)
