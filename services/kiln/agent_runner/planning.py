"""Asking the cost model for a compilation's parallelism plan."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from kiln.agent_runner.errors import Failure
from kiln.common.backoff import backoff_s
from kiln.v1 import common_pb2, cost_model_pb2

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def choose_plan(
    stub: Any,
    workload: common_pb2.Workload,
    *,
    addr: str,
    timeout_s: float,
    attempts: int,
    outage_s: float = 0.0,
) -> dict[str, Any]:
    """The cost model's best feasible plan (``CostModel.Plan`` with ``max_plans`` 1) as JSON
    (``ParallelismPlan`` with proto field names).

    Args:
        stub: a ``kiln.v1.CostModel`` grpc.aio stub.
        workload: the validated workload.
        addr: the cost model's address (for messages).
        timeout_s: deadline of one call, seconds.
        attempts: tries while the cost model is UNAVAILABLE or times out (0.5 s, 1 s, ...
            apart, jittered, at most 5 s).
        outage_s: keep trying an UNAVAILABLE cost model (restarting: seconds) for this long
            since the first try, past ``attempts``.

    Raises:
        Failure: unreachable after ``attempts`` tries and ``outage_s``; any other error status
            (its code and message); or no feasible plan (the pruning reasons).
    """
    request = cost_model_pb2.PlanRequest(workload=workload, max_plans=1)
    last, tries = "", 0
    give_up_at = time.monotonic() + outage_s
    while True:
        tries += 1
        try:
            reply = await stub.Plan(request, timeout=timeout_s)
            break
        except grpc.aio.AioRpcError as err:
            if err.code() not in _RETRYABLE:
                raise Failure(
                    f"the cost model refused the workload: {err.code().name}: {err.details()}"
                ) from None
            last = f"{err.code().name}: {err.details()}"
            outage = err.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < give_up_at
            if tries >= max(1, attempts) and not outage:
                raise Failure(
                    f"the cost model at {addr} is unreachable after {tries} attempts ({last})"
                ) from None
            await asyncio.sleep(backoff_s(tries, max_s=5.0))
    if not reply.plans:
        reasons = sorted({p.infeasible_reason for p in reply.pruned if p.infeasible_reason})
        raise Failure(
            f"no feasible parallelism plan for {workload.hardware.name}: "
            + ("; ".join(reasons[:3]) or "the cost model returned none")
        )
    return MessageToDict(reply.plans[0], preserving_proto_field_name=True)
