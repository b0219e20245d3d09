"""``python -m kiln.workloads.traffic FILE...``: print the traffic shape of each trace."""

from __future__ import annotations

import argparse
import sys
import time

from kiln.workloads.traffic.concurrency import estimate_concurrency
from kiln.workloads.traffic.prefix import block_reuse_rate
from kiln.workloads.traffic.readers import TraceError
from kiln.workloads.traffic.shape import DEFAULT_MAX_BATCH, TrafficShape
from kiln.workloads.traffic.stats import Distribution
from kiln.workloads.traffic.trace_files import read_trace


def _dist(d: Distribution) -> str:
    return (
        f"p50 {d.p50:,.1f}  p90 {d.p90:,.1f}  p99 {d.p99:,.1f}  "
        f"mean {d.mean:,.1f}  max {d.max:,.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    """Print the shape of each file; exit status 1 if any could not be read."""
    parser = argparse.ArgumentParser(prog="python -m kiln.workloads.traffic", description=__doc__)
    parser.add_argument("files", nargs="+", metavar="FILE")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH)
    args = parser.parse_args(argv)
    status = 0
    for path in args.files:
        start = time.perf_counter()
        try:
            trace = read_trace(path)
        except (TraceError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            status = 1
            continue
        shape = TrafficShape.from_trace(trace, max_batch=args.max_batch)
        conc = estimate_concurrency(trace.requests)
        elapsed = time.perf_counter() - start
        print(
            f"{shape.source}  ({trace.format}, {len(trace.requests):,} requests, {elapsed:.2f} s)"
        )
        print(f"  isl tokens        {_dist(shape.isl_tokens)}")
        print(f"  osl tokens        {_dist(shape.osl_tokens)}")
        print(
            f"  arrival rate      {shape.arrival_rate_rps:.3f} req/s, "
            f"inter-arrival CV {shape.interarrival_cv:.3f}"
        )
        print(
            f"  concurrency       mean {shape.mean_concurrency:.2f}, peak {conc.max}, "
            f"Little's law {conc.littles_law:.2f} (estimated)"
        )
        print(
            f"  prefix hit rate   {shape.prefix_hit_rate:.4f} token-weighted "
            f"(blocks seen before {block_reuse_rate(trace.requests):.4f})"
        )
        print(f"  operating point   batch {shape.batch_size}, context {shape.context_len} tokens")
        print(
            f"  skipped rows      {len(trace.problems)}; reordered {trace.reordered}; "
            f"0-output kept {trace.zero_output}"
        )
        for note in shape.notes:
            print(f"  note: {note}")
    return status


if __name__ == "__main__":
    sys.exit(main())
