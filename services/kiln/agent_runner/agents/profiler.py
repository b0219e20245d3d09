"""Profile-guided search: attack the op whose measured time is furthest above its roofline.

Every candidate this agent measures is profiled (``wants_profiles``). From the newest leader
with a profile it ranks ops by measured minus roofline ms (:mod:`kiln.agent_runner.op_roofline`
at that profile's operating point and the target's achievable bandwidth; an unknown target
falls back to the ``cpu`` entry, logged) and proposes the top op's untried alternatives on top of
the best candidate so far, then the next op's. Without a profile or a workload it has nothing to
propose.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.agent_runner.agents.base import Agent, Lab, Proposal
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.op_roofline import bandwidth_bytes_per_s, op_bytes, roofline_ms
from kiln.agent_runner.results import Seen
from kiln.agent_runner.space import OP_PREFIX, CandidateSpace
from kiln.common.errors import NotFound
from kiln.common.logging import get_logger
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.workloads.config import ModelConfig, parse_config

log = get_logger("kiln.agent_runner.profiler")


@dataclass(frozen=True)
class OpGap:
    """One op of a profile: measured and roofline ms per decode step, and their difference."""

    op: str
    measured_ms: float
    roofline_ms: float

    @property
    def gap_ms(self) -> float:
        """Measured - roofline, ms (negative when the op beats the modelled floor)."""
        return self.measured_ms - self.roofline_ms


def rank_gaps(
    op_ms: dict[str, float], shape: dict[str, int], config: ModelConfig, bandwidth: float
) -> list[OpGap]:
    """Ops of a profile, largest gap first (ties by name): ``op_ms`` and ``shape`` as the
    engine's ``op_ms`` and ``op_profile_shape``, ``bandwidth`` in bytes/s. KeyError when
    ``shape`` lacks a field, ValueError as :func:`~kiln.agent_runner.op_roofline.op_bytes`.
    """
    floor = roofline_ms(
        op_bytes(
            config,
            layers=shape["layers"],
            batch_size=shape["batch_size"],
            context_len=shape["context_len"],
            dtype_bytes=shape["dtype_bytes"],
        ),
        bandwidth,
    )
    gaps = [OpGap(op, ms, floor.get(op, 0.0)) for op, ms in op_ms.items()]
    return sorted(gaps, key=lambda g: (-g.gap_ms, g.op))


class ProfilerAgent(Agent):
    """Largest roofline gap first."""

    kind = "profiler"
    wants_profiles = True

    def __init__(self, name: str, seed: int) -> None:
        super().__init__(name, seed)
        self.config: ModelConfig | None = None
        self.bandwidth: float = 0.0
        self._ranked: list[OpGap] = []
        self._ranked_for: str | None = None
        """Candidate id of the profile the ranking comes from."""

    def configure(self, config: ModelConfig, hardware: str) -> None:
        """Set the model and the hardware target (the loop does it from ``lab.workload``)."""
        self.config = config
        try:
            self.bandwidth, _ = bandwidth_bytes_per_s(hardware)
        except NotFound:
            log.warning("unknown hardware: the cpu entry's bandwidth stands in", hardware=hardware)
            self.bandwidth, _ = bandwidth_bytes_per_s("cpu")

    async def next_proposal(self, view: BoardView, lab: Lab) -> Proposal | None:
        """Configure from the Lab's workload on first use, then :meth:`propose`."""
        if self.config is None:
            workload: Any = getattr(lab, "workload", None)
            if workload is None:
                log.warning("profiler: the lab has no workload; nothing to propose")
                return None
            model = workload.model
            config = parse_config(json.loads(model.config_json), model.name or "model")
            self.configure(config, workload.hardware.name or "cpu")
        return self.propose(view, lab.space)

    def ranking(self, view: BoardView) -> list[OpGap]:
        """The gap ranking of the fastest correct profiled result; empty without one or before
        :meth:`configure`.
        """
        if self.config is None:
            return []
        profiled = [s for s in view.ranked() if s.op_ms and s.op_profile_shape]
        if not profiled:
            return []
        lead = profiled[0]
        if lead.candidate.id != self._ranked_for:
            self._ranked = rank_gaps(lead.op_ms, lead.op_profile_shape, self.config, self.bandwidth)
            self._ranked_for = lead.candidate.id
            top = ", ".join(f"{g.op} {g.gap_ms:.3g} ms" for g in self._ranked[:3])
            log.info("profiler re-ranked ops", agent=self.name, lead=lead.candidate.id, top=top)
        return self._ranked

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """The first unclaimed, untried alternative of the op with the largest gap, on the best
        so far.
        """
        ranked = self.ranking(view)
        if not ranked:
            return None
        best = view.ranked()[0] if view.ranked() else Seen(REFERENCE_CANDIDATE, 0.0, True, "")
        point = space.assignment(best.candidate)
        dims = {d.op: d for d in space.dims if d.op is not None}
        for gap in ranked:
            dim = dims.get(gap.op)
            if dim is None:
                continue
            for value in dim.values:
                if value == point[dim.name]:
                    continue
                moved = {**point, dim.name: value}
                candidate = space.candidate(moved)
                if (
                    candidate.is_reference
                    or candidate.id in view.claimed
                    or candidate.id in self.tried
                    or space.excluded(moved) is not None
                ):
                    continue
                why = (
                    f"op {gap.op}: measured {gap.measured_ms:.4g} ms/step vs roofline "
                    f"{gap.roofline_ms:.4g} ms/step (gap {gap.gap_ms:.4g} ms); on "
                    f"{best.candidate.describe()}: {OP_PREFIX}{gap.op} -> {value or 'reference'}"
                )
                return Proposal(candidate, why)
        return None
