"""The engine pool's own settings, from environment variables with prefix ``KILN_ENGINE_``.

They sit beside :class:`kiln.common.settings.KilnSettings` (addresses, NATS, ledger) and hold
what only engines care about: the device, the caps on the traffic shape an engine is built for,
how experiments are timed, and how the work queue is consumed. Defaults suit a CPU host.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.engine_pool.spec import EngineLimits


class EngineSettings(BaseSettings):
    """Engine pool settings; each field maps to ``KILN_ENGINE_<FIELD>`` in upper case."""

    model_config = SettingsConfigDict(env_prefix="KILN_ENGINE_", extra="ignore")

    # --- what engines are built for ------------------------------------------------------
    device: str = Field(default="cpu", description='Device engines run on: "cpu", "cuda:0", ...')
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="Engine dtype: auto = the workload's model.dtype when set, else the "
        "config's torch_dtype where the device computes it natively (CUDA; CPUs with "
        "AVX512-BF16/AMX), else float32; anything else forces that dtype for every engine.",
    )
    max_batch: int = Field(
        default=8, ge=1, description="Cap on the traffic shape's batch (sequences)."
    )
    max_context: int = Field(
        default=512, ge=2, description="Cap on the shape's context length, tokens."
    )
    fast_layers: int = Field(default=2, ge=1, description="Layers of a fast-tier engine.")
    prompt_len: int = Field(default=16, ge=1, description="Prompt tokens of the correctness check.")
    check_steps: int = Field(default=1, ge=0, description="Decode steps checked after the prefill.")
    check_batch: int = Field(
        default=2, ge=1, description="Prompts of the correctness check (full batch at the shape)."
    )
    max_engines: int | None = Field(
        default=None, ge=1, description="Engines held at once (LRU eviction); unset = 1 per device."
    )

    # --- how experiments are timed --------------------------------------------------------
    warmup: int = Field(
        default=1,
        ge=0,
        description="Untimed decode steps at the traffic shape before timing (at least one "
        "runs: the first is the step checked at the shape).",
    )
    repeats: int = Field(default=20, ge=1, description="Timed decode steps at most.")
    min_repeats: int = Field(default=5, ge=1, description="Timed decode steps at least.")
    measure_budget_s: float = Field(
        default=0.5,
        ge=0,
        description="Timing stops once min_repeats steps ran and this many seconds were spent "
        "timing (Triton do_bench style), or after repeats steps.",
    )
    ready_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest engine build, seconds."
    )
    default_deadline_s: float = Field(
        default=300.0,
        gt=0,
        le=3600,
        description="Deadline of a RunExperiment call that sets none, s.",
    )

    # --- the work queue -------------------------------------------------------------------
    consume: bool = Field(
        default=True, description="Consume the NATS work queue (False: gRPC only)."
    )
    ack_wait_s: float = Field(
        default=30.0,
        gt=1,
        description="JetStream ack wait, seconds; in_progress() heartbeats every "
        "third of it keep a running experiment's message from being redelivered.",
    )
    max_deliver: int = Field(default=3, ge=1, description="Deliveries of one work item at most.")
    nak_delay_s: float = Field(
        default=5.0, ge=0, description="Redelivery delay after a nak, seconds."
    )

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v != "cpu" and not v.startswith("cuda"):
            raise ValueError('device must be "cpu" or "cuda[:N]"')
        return v

    def limits(self) -> EngineLimits:
        """The part of the settings that shapes an :class:`~kiln.engine_pool.spec.EngineSpec`."""
        return EngineLimits(
            device=self.device,
            dtype=None if self.dtype == "auto" else self.dtype,
            max_batch=self.max_batch,
            max_context=self.max_context,
            fast_layers=self.fast_layers,
            prompt_len=self.prompt_len,
            check_steps=self.check_steps,
            check_batch=self.check_batch,
        )

    def engines_per_device(self) -> int:
        """How many engines the pool holds at once (``max_engines``, default 1)."""
        return self.max_engines or 1
