"""The engine pool's own settings, from environment variables with prefix ``KILN_ENGINE_``.

They sit beside :class:`kiln.common.settings.KilnSettings` (addresses, NATS, ledger) and hold
what only engines care about: the device, the caps on the traffic shape an engine is built for,
how experiments are timed, and how the work queue is consumed. Defaults suit a CPU host; on a
CUDA device (``KILN_ENGINE_DEVICE=cuda...``) every field left unset takes its value from
:data:`CUDA_DEFAULTS` instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.runtime.sandbox.user import GID_ENV, UID_ENV, configured_user
from kiln.runtime.spec import EngineLimits
from kiln.runtime.timed_verification import VERIFY_TIMED_STEPS

CUDA_DEFAULTS: dict[str, Any] = {
    "max_batch": 1024,
    "max_context": 131072,
    "warmup": 2,
    "repeats": 200,
    "min_repeats": 10,
    "full_min_repeats": 10,
    "measure_budget_s": 0.01,
    "prefill_repeats": 3,
}
"""Defaults for CUDA engines: the traffic shape is capped by device memory, not by these
(``kiln.runtime.device_memory``). A decode step takes 0.4–20 ms on an H200 (Llama-3.2-1B
batch 1, fast tier with a CUDA graph to full tier eager), so timing stops after 10 steps and
10 ms of them (about 20 steps of a graphed fast-tier step, whose spread is under 1 %; Triton's
``do_bench`` uses 100 ms); the spread is reported with every measurement."""


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
    max_layers: int | None = Field(
        default=None,
        ge=1,
        description="Most layers an engine of either tier holds (unset = all): a full-tier "
        "engine of a model too big for the host is scaled to fit by layer count.",
    )
    prompt_len: int = Field(default=16, ge=1, description="Prompt tokens of the correctness check.")
    check_steps: int = Field(default=1, ge=0, description="Decode steps checked after the prefill.")
    check_batch: int = Field(
        default=2, ge=1, description="Prompts of the correctness check (full batch at the shape)."
    )
    threads: str = Field(
        default="auto",
        pattern=r"^(auto|[1-9][0-9]*)$",
        description="Intra-op threads of a CPU engine: a number, or auto = the host's cores "
        "less one, leaving a core to the services that share the host "
        "(kiln.engine_pool.worker.cpu_threads). The threads transform overrides it per "
        "experiment.",
    )
    max_engines: int | None = Field(
        default=None,
        ge=1,
        description="Engines held at once per device (LRU eviction); unset = 2, so a "
        "compilation's fast engine and the full engine that confirms its winners both stay warm.",
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
    full_min_repeats: int = Field(
        default=10,
        ge=1,
        description="Timed decode steps at least on the full tier, where confirmations are "
        "judged by whether the candidate's p10-p90 band clears the reference's "
        "(kiln.agent_runner.judge.distinguishable): with 5 steps one slow outlier moves the p90 "
        "most of the way to itself, with 10 a tenth of the way. The larger of this and "
        "min_repeats applies there.",
    )
    measure_budget_s: float = Field(
        default=0.5,
        ge=0,
        description="Timing stops once min_repeats steps ran and this many seconds were spent "
        "timing (Triton do_bench style), or after repeats steps.",
    )
    prefill_repeats: int = Field(
        default=0,
        ge=0,
        le=100,
        description="Timed prefills of batch x context tokens per experiment, after the decode "
        "timing (TTFT at the shape); 0 = none (CPU default: a prefill there costs seconds).",
    )
    verify_timed_steps: int = Field(
        default=VERIFY_TIMED_STEPS,
        ge=0,
        description="Timed steps whose outputs are checked against the reference after timing, "
        "at most (all when fewer ran), chosen at random after each call returned: a candidate "
        "cheating on a fraction p of its timed steps escapes with probability (1-p)^k. The "
        "default, 21, is the smallest k with 0.8^k < 1 % (kiln.runtime.timed_verification); "
        "the kept steps are verified together in as few reference forwards as fit in memory.",
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

    def min_repeats_for(self, tier: str) -> int:
        """Timed decode steps at least for an experiment on ``tier`` ("fast" or "full"),
        capped by ``repeats``."""
        least = max(self.min_repeats, self.full_min_repeats) if tier == "full" else self.min_repeats
        return min(least, self.repeats)

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
    max_deliver: int = Field(
        default=3,
        ge=1,
        description="Attempts to run one work item whose run fails for a reason of the host "
        "(its engine cannot be built here, the engine process died mid-experiment), made "
        "nak_delay_s apart while the pool holds the message; then it is recorded CRASHED.",
    )
    nak_delay_s: float = Field(
        default=5.0,
        ge=0,
        description="Pause between attempts, and redelivery delay after a nak, seconds.",
    )
    max_redeliveries: int = Field(
        default=10,
        ge=1,
        description="Deliveries of one work item (redelivered after a pool died holding it, or "
        "NATS lost its heartbeats) after which it is recorded CRASHED without running again. "
        "JetStream itself never stops delivering (its max_deliver is unlimited), so no work "
        "item is dropped without an ExperimentCompleted.",
    )
    outage_wait_s: float = Field(
        default=900.0,
        gt=0,
        description="How long one delivery waits for an unavailable ledger (retrying with "
        "backoff while it holds the message) before it naks the message, seconds. Waiting "
        "spends no delivery.",
    )
    hardware: str = Field(
        default="",
        description="Hardware kinds (workload.hardware.name) whose queued experiments this "
        "pool takes, comma-separated, among its devices' own kinds: empty or '*' = every kind "
        "its devices have. A kind none of its devices has is ignored (logged): a pool never "
        "measures one hardware's work on another (KILN_ENGINE_DEVICE_KIND names a GPU's kind).",
    )
    models: str = Field(
        default="",
        description="Model keys (kiln.common.work.model_key; ListEngines shows them) whose "
        "queued experiments this pool takes, comma-separated; empty = every model.",
    )
    full_max_wait_s: float = Field(
        default=60.0,
        gt=0,
        le=86400,
        description="Longest a full-tier (confirmation) work subject waits for a device whose "
        "engines are all busy with other subjects' warm engines, seconds: past it the device "
        "takes it even if that evicts a warm engine (kiln.engine_pool.schedule).",
    )
    fast_max_wait_s: float = Field(
        default=300.0,
        gt=0,
        le=86400,
        description="The same bound for a fast-tier (search) work subject, seconds.",
    )
    discover_s: float = Field(
        default=2.0,
        gt=0,
        description="How often the work stream is scanned for subjects (models) not yet "
        "consumed and for queued work, seconds (new work is also noticed as it is published).",
    )

    # --- devices and the pool registry ----------------------------------------------------
    devices: str = Field(
        default="",
        description="Devices, one engine process each (kiln.engine_pool.devices): 'auto' = "
        "every visible CUDA device, else the CPU; or a comma list ('cuda:0,cuda:1', 'cpu'; "
        "'cuda' = every visible GPU). Empty = KILN_ENGINE_DEVICE when set, else auto.",
    )
    device_kind: str = Field(
        default="",
        description="Hardware kind of this host's GPUs (h100, h200, ...) when their name does "
        "not tell; empty = from the name.",
    )
    pool_id: str = Field(
        default="",
        description="This pool's id in the registry and in engine ids; empty = <host>-<pid>.",
    )
    heartbeat_s: float = Field(
        default=5.0,
        gt=0,
        description="How often the pool re-registers itself and its engines, seconds "
        "(at most a third of the registry TTL is used).",
    )
    registry_ttl_s: float = Field(
        default=30.0,
        ge=1,
        description="Seconds after its last heartbeat at which a pool drops out of the "
        "registry (the TTL of the JetStream key-value bucket; its first creator sets it).",
    )

    # --- the sandbox's user (read by the engine's sandbox host itself; checked here early) --
    sandbox_uid: str | None = Field(
        default=None,
        validation_alias=UID_ENV,
        description="KILN_SANDBOX_UID: the uid a root engine's sandbox switches to before it "
        "loads candidate code (1..2^32-2; unset = 65534, nobody). An engine that is not root "
        "keeps its own user (kiln.runtime.sandbox.user).",
    )
    sandbox_gid: str | None = Field(
        default=None,
        validation_alias=GID_ENV,
        description="KILN_SANDBOX_GID: its gid (unset = the uid's group, else the uid).",
    )

    @model_validator(mode="after")
    def _check_sandbox_user(self) -> EngineSettings:
        given = {UID_ENV: self.sandbox_uid, GID_ENV: self.sandbox_gid}
        configured_user({k: v for k, v in given.items() if v})
        return self

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v != "cpu" and not v.startswith("cuda"):
            raise ValueError('device must be "cpu" or "cuda[:N]"')
        return v

    @model_validator(mode="after")
    def _cuda_defaults(self) -> EngineSettings:
        if self.device.startswith("cuda"):
            for name, value in CUDA_DEFAULTS.items():
                if name not in self.model_fields_set:
                    setattr(self, name, value)
        return self

    def limits(self) -> EngineLimits:
        """The part of the settings that shapes an :class:`~kiln.runtime.spec.EngineSpec`."""
        return EngineLimits(
            device=self.device,
            dtype=None if self.dtype == "auto" else self.dtype,
            max_batch=self.max_batch,
            max_context=self.max_context,
            fast_layers=self.fast_layers,
            prompt_len=self.prompt_len,
            check_steps=self.check_steps,
            check_batch=self.check_batch,
            max_layers=self.max_layers,
        )

    def engines_per_device(self) -> int:
        """How many engines the pool holds at once per device (``max_engines``, default 2)."""
        return self.max_engines or 2
