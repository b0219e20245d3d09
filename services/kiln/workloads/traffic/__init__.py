"""Traffic shapes from real serving traces (Azure LLM inference CSV, Mooncake JSONL, ServeGen).

``read_trace(path)`` gives the requests; ``TrafficShape.from_trace(trace)`` their shape and the
operating point (decode batch size, context length) engines measure at. Stdlib and structlog
only; protobuf is imported only by ``TrafficShape.to_proto``.
"""

from kiln.workloads.traffic.concurrency import Concurrency, ServiceModel, estimate_concurrency
from kiln.workloads.traffic.experts import block_popularity_exponent, zipf_shares
from kiln.workloads.traffic.prefix import block_reuse_rate, prefix_hit_rate
from kiln.workloads.traffic.readers import TraceError, read_azure_csv, read_mooncake_jsonl
from kiln.workloads.traffic.records import Request, RowProblem, Trace
from kiln.workloads.traffic.servegen import read_servegen_client, read_servegen_requests
from kiln.workloads.traffic.shape import (
    TrafficShape,
    operating_batch_size,
    operating_context_len,
)
from kiln.workloads.traffic.stats import Distribution, percentile
from kiln.workloads.traffic.trace_files import read_trace

__all__ = [
    "Concurrency",
    "Distribution",
    "Request",
    "RowProblem",
    "ServiceModel",
    "Trace",
    "TraceError",
    "TrafficShape",
    "block_popularity_exponent",
    "block_reuse_rate",
    "estimate_concurrency",
    "operating_batch_size",
    "operating_context_len",
    "percentile",
    "prefix_hit_rate",
    "read_azure_csv",
    "read_mooncake_jsonl",
    "read_servegen_client",
    "read_servegen_requests",
    "read_trace",
    "zipf_shares",
]
