"""The traffic shape a compilation optimizes for, read from a trace (``kiln.v1.TrafficShape``), with
the operating point engines measure at (formulas: :mod:`kiln.domain.operating_point`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

from kiln.domain.operating_point import (
    DEFAULT_MAX_BATCH,
    operating_batch_size,
    operating_context_len,
)
from kiln.workloads.traffic.concurrency import ServiceModel, estimate_concurrency
from kiln.workloads.traffic.experts import block_popularity_exponent
from kiln.workloads.traffic.prefix import MOONCAKE_BLOCK_TOKENS, prefix_hit_rate
from kiln.workloads.traffic.records import Request, Trace
from kiln.workloads.traffic.stats import Distribution, coefficient_of_variation

if TYPE_CHECKING:
    from kiln.v1 import common_pb2

NOTE_CONCURRENCY = (
    "mean_concurrency is estimated: traces have no completion times, so durations come from an "
    "unloaded service model (isl / {prefill:g} tok/s + osl x {tpot:g} s)"
)
NOTE_NO_HASHES = "prefix_hit_rate is 0.0: the trace has no prefix-block hash ids"
NOTE_SKEW = "expert_load_skew {skew:g} was given, not derived: request traces carry no MoE routing"
NOTE_ZIPF = (
    "expert_zipf_exponent {s:.3g}: Zipf MLE of prompt-block popularity, a proxy for MoE "
    "expert-load skew (kiln.workloads.traffic.experts)"
)
NOTE_NO_ZIPF = "expert_zipf_exponent is 0.0 (balanced experts): the trace has no block hash ids"
NOTE_NO_SPAN = "arrival_rate_rps and interarrival_cv are 0.0: all arrivals at one instant"


@dataclass(frozen=True)
class TrafficShape:
    """What the forward pass will serve (tokens; rates requests/s).

    Attributes:
        source: trace file name, or ``"synthetic"``.
        isl_tokens, osl_tokens: prompt and output length distributions.
        arrival_rate_rps: (requests - 1) / (last arrival - first arrival).
        interarrival_cv: population std / mean of arrival gaps (1.0 = Poisson).
        mean_concurrency: time-averaged requests in flight (an estimate,
            :mod:`kiln.workloads.traffic.concurrency`).
        prefix_hit_rate: token-weighted fraction of prompt tokens in a cached prefix, 0..1
            (:mod:`kiln.workloads.traffic.prefix`).
        expert_load_skew: hottest expert's share over uniform (>= 1); passed by the caller (default
            1.0), not derived.
        expert_zipf_exponent: expert-load Zipf exponent s >= 0 from the trace's block popularity
            (:mod:`kiln.workloads.traffic.experts`), 0.0 without block ids.
        batch_size, context_len: the operating point (decode batch; context tokens).
        notes: caveats; not sent on the wire, not compared.
    """

    source: str
    isl_tokens: Distribution
    osl_tokens: Distribution
    arrival_rate_rps: float
    interarrival_cv: float
    mean_concurrency: float
    prefix_hit_rate: float
    expert_load_skew: float = 1.0
    expert_zipf_exponent: float = 0.0
    batch_size: int = 1
    context_len: int = 1
    notes: tuple[str, ...] = field(default=(), compare=False)

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[Request],
        source: str = "synthetic",
        *,
        service: ServiceModel | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        expert_load_skew: float = 1.0,
        block_size: int = MOONCAKE_BLOCK_TOKENS,
    ) -> TrafficShape:
        """The shape of ``requests`` (arrival order; ties keep the given order); ``service``: the
        model behind ``mean_concurrency`` (default :class:`ServiceModel`); ``max_batch`` clamps
        ``batch_size``; ``block_size``: tokens per ``hash_ids`` block (Mooncake 512).

        Raises:
            ValueError: no requests, or ``max_batch < 1``.
        """
        if not requests:
            raise ValueError("a traffic shape needs at least one request")
        model = service or ServiceModel()
        ordered = sorted(requests, key=lambda r: r.arrival_s)
        notes = [NOTE_CONCURRENCY.format(prefill=model.prefill_tokens_per_s, tpot=model.tpot_s)]

        times = [r.arrival_s for r in ordered]
        span = times[-1] - times[0]
        gaps = [b - a for a, b in pairwise(times)]
        rate = (len(times) - 1) / span if span > 0 else 0.0
        if len(times) > 1 and span <= 0:
            notes.append(NOTE_NO_SPAN)

        if any(r.hash_ids for r in ordered):
            hit = prefix_hit_rate(ordered, block_size)
            zipf = block_popularity_exponent(ordered)
            notes.append(NOTE_ZIPF.format(s=zipf))
        else:
            hit = zipf = 0.0
            notes += [NOTE_NO_HASHES, NOTE_NO_ZIPF]
        notes.append(NOTE_SKEW.format(skew=expert_load_skew))

        isl = Distribution.of([r.isl for r in ordered])
        osl = Distribution.of([r.osl for r in ordered])
        concurrency = estimate_concurrency(ordered, model).mean
        return cls(
            source=source,
            isl_tokens=isl,
            osl_tokens=osl,
            arrival_rate_rps=rate,
            interarrival_cv=coefficient_of_variation(gaps),
            mean_concurrency=concurrency,
            prefix_hit_rate=hit,
            expert_load_skew=expert_load_skew,
            expert_zipf_exponent=zipf,
            batch_size=operating_batch_size(concurrency, max_batch),
            context_len=operating_context_len(isl.p50, osl.p50),
            notes=tuple(notes),
        )

    @classmethod
    def from_trace(
        cls,
        trace: Trace,
        *,
        service: ServiceModel | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        expert_load_skew: float = 1.0,
        block_size: int = MOONCAKE_BLOCK_TOKENS,
    ) -> TrafficShape:
        """The shape of a trace read by :func:`~kiln.workloads.traffic.trace_files.read_trace`,
        named after its file; the other arguments as :meth:`from_requests`."""
        return cls.from_requests(
            trace.requests,
            trace.path.name,
            service=service,
            max_batch=max_batch,
            expert_load_skew=expert_load_skew,
            block_size=block_size,
        )

    def to_proto(self) -> common_pb2.TrafficShape:
        """The wire message (``notes`` are not sent)."""
        from kiln.v1 import common_pb2

        def dist(d: Distribution) -> common_pb2.Distribution:
            return common_pb2.Distribution(p50=d.p50, p90=d.p90, p99=d.p99, mean=d.mean, max=d.max)

        return common_pb2.TrafficShape(
            source=self.source,
            isl_tokens=dist(self.isl_tokens),
            osl_tokens=dist(self.osl_tokens),
            arrival_rate_rps=self.arrival_rate_rps,
            interarrival_cv=self.interarrival_cv,
            mean_concurrency=self.mean_concurrency,
            prefix_hit_rate=self.prefix_hit_rate,
            expert_load_skew=self.expert_load_skew,
            expert_zipf_exponent=self.expert_zipf_exponent,
            batch_size=self.batch_size,
            context_len=self.context_len,
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.TrafficShape) -> TrafficShape:
        """The shape a wire message carries (with no notes)."""

        def dist(d: common_pb2.Distribution) -> Distribution:
            return Distribution(p50=d.p50, p90=d.p90, p99=d.p99, mean=d.mean, max=d.max)

        return cls(
            source=msg.source,
            isl_tokens=dist(msg.isl_tokens),
            osl_tokens=dist(msg.osl_tokens),
            arrival_rate_rps=msg.arrival_rate_rps,
            interarrival_cv=msg.interarrival_cv,
            mean_concurrency=msg.mean_concurrency,
            prefix_hit_rate=msg.prefix_hit_rate,
            expert_load_skew=msg.expert_load_skew,
            expert_zipf_exponent=msg.expert_zipf_exponent,
            batch_size=msg.batch_size,
            context_len=msg.context_len,
        )
