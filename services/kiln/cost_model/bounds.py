"""Ranges of a plan request's numbers: the device count and a plan's parallel degrees.

The planner enumerates power-of-two TP x PP x DP (and EP, DCP, MoE TP) splits of the device
count, so its work grows with the count; at ``MAX_DEVICES`` the largest catalogue model
(DeepSeek-V3) has 8,043 candidate plans (TP within a node, PP up to the layers; ~1.2 s on a
2-core host), which the planner costs within ``kiln.cost_model.service.PLAN_DEADLINE_S`` or
answers DEADLINE_EXCEEDED. Out of range: :class:`~kiln.common.errors.OutOfRange`.
"""

from __future__ import annotations

from kiln.common.errors import OutOfRange
from kiln.domain.operating_point import MAX_BATCH

MAX_DEVICES = 65_536
"""Most devices one plan may span: the largest training clusters published have ~10^5 GPUs;
inference deployments of one model are far smaller. 2^16 keeps enumeration bounded."""
PLAN_DEGREES = ("tp", "ep", "dp", "pp", "dcp", "moe_tp")


def check_devices(num_devices: int, field: str = "workload.hardware.num_devices") -> int:
    """``num_devices`` if within 0..MAX_DEVICES (0: the catalogue's node size); OutOfRange."""
    if not 0 <= num_devices <= MAX_DEVICES:
        raise OutOfRange(f"{field} = {num_devices} is out of range 0..{MAX_DEVICES}")
    return num_devices


def check_plan_degrees(degrees: dict[str, int], batch_size: int) -> None:
    """A plan's degrees each within 0..MAX_DEVICES (0 reads as 1) and ``batch_size`` within
    0..MAX_BATCH (0: the workload's); OutOfRange naming the first one beyond."""
    for name in PLAN_DEGREES:
        value = degrees.get(name, 0)
        if not 0 <= value <= MAX_DEVICES:
            raise OutOfRange(f"plan.{name} = {value} is out of range 0..{MAX_DEVICES}")
    if not 0 <= batch_size <= MAX_BATCH:
        raise OutOfRange(f"plan.batch_size = {batch_size} is out of range 0..{MAX_BATCH}")
