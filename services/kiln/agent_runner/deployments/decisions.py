"""Drift decisions of one deployment: the detector rebuilt from the deployment's stream, and the
cost model's predicted throughput drop at a window's shape.

The detector is a pure fold (Contract 1), so the controller rebuilds it by observing every
recorded ``TrafficWindowObserved`` again (its recorded measure, sparseness and predicted drop)
and rebasing where a ``CandidatePromoted`` or ``PromotionDeclined`` recorded ``rebased_at_s``:
after a restart it is in the state it was in before.

Predicted drop: the cost model's roofline (``CostModel.Plan``, best feasible plan's
``throughput_tokens_per_s``) at the proven shape and at the window's shape,
``1 - window / proven``. The roofline knows the workload (model, hardware, batch, context),
not the candidate: it predicts how the operating point's attainable throughput moves, which is
what the active candidate's throughput moves with when the shape changes; it cannot see a
candidate that suits one shape and not another. None when the cost model cannot answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from google.protobuf.json_format import ParseDict

from kiln.common.logging import get_logger
from kiln.domain.compilation import Event
from kiln.v1 import common_pb2, cost_model_pb2, cost_model_pb2_grpc
from kiln.workloads.traffic.drift import DriftDetector, DriftMeasure, DriftPolicy

log = get_logger("kiln.agent_runner.deployments.decisions")


def rebuild_detector(policy: DriftPolicy, events: Iterable[Event]) -> DriftDetector:
    """The detector after the recorded windows and rebases of ``events`` (stream order)."""
    detector = DriftDetector(policy)
    for event in events:
        d = event.data
        if event.type == "TrafficWindowObserved" and d.get("drift"):
            detector.observe(
                DriftMeasure.from_dict(d["drift"]),
                float(d["end_s"]),
                sparse=bool(d.get("sparse")),
                predicted_drop=d.get("predicted_drop"),
            )
        elif event.type in ("CandidatePromoted", "PromotionDeclined"):
            if d.get("rebased_at_s") is not None:
                detector.rebase(float(d["rebased_at_s"]))
    return detector


class ThroughputPredictor:
    """The cost model's predicted tokens/s of a workload at a shape, cached by shape.

    Args:
        cost_model: the team's CostModel stub (the agent runner's ``_cost_model``).
        workload: the deployment's workload as JSON (model and hardware; traffic replaced).
    """

    def __init__(
        self,
        cost_model: Callable[[str], cost_model_pb2_grpc.CostModelStub],
        team: str,
        workload: Mapping[str, Any],
    ) -> None:
        self._stub = cost_model
        self._team = team
        self._workload = dict(workload)
        self._cache: dict[str, float | None] = {}

    async def tokens_per_s(self, shape: Mapping[str, Any]) -> float | None:
        """The best feasible plan's ``throughput_tokens_per_s`` at ``shape``; None when the
        cost model fails or finds no feasible plan."""
        key = json.dumps(shape, sort_keys=True)
        if key in self._cache:
            return self._cache[key]
        workload = ParseDict(
            {**self._workload, "traffic": dict(shape)},
            common_pb2.Workload(),
            ignore_unknown_fields=True,
        )
        value: float | None = None
        try:
            call: Any = self._stub(self._team).Plan(
                cost_model_pb2.PlanRequest(workload=workload, max_plans=1), timeout=10
            )
            reply = await call
            if reply.plans and reply.plans[0].throughput_tokens_per_s > 0:
                value = float(reply.plans[0].throughput_tokens_per_s)
        except Exception as exc:  # the trigger is optional: no prediction, no trigger
            log.warning("no throughput prediction", error=str(exc)[:200])
        self._cache[key] = value
        if len(self._cache) > 256:
            self._cache.pop(next(iter(self._cache)))
        return value

    async def predicted_drop(
        self, proven: Mapping[str, Any], window: Mapping[str, Any]
    ) -> float | None:
        """``1 - tokens/s(window) / tokens/s(proven)``, None when either is unknown."""
        old = await self.tokens_per_s(proven)
        new = await self.tokens_per_s(window)
        if old is None or new is None or old <= 0:
            return None
        return 1.0 - new / old
