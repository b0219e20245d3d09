"""A serving model: TTFT and TPOT as distributions under continuous batching with chunked
prefill, from a plan's roofline step times.

Load: a closed loop of ``concurrency`` users per DP replica (``ceil(B / dp)``), each sending its
next request (``isl`` prompt tokens, ``osl`` output tokens) when the last one finishes -- the way
serving benchmarks drive an engine at a fixed concurrency. Scheduler (vLLM V1 / SGLang style):
every step decodes one token for each running sequence and spends the rest of a token budget
of ``chunk`` on prompts, first come first served, a prompt's first token coming with the step
that finishes its prefill. Step time (the roofline of one mixed forward): ``fixed + max(decode
memory time at n running, prefill compute time of the step's prompt tokens)``, both read off
the plan's estimate (:func:`step_times`). The first ``concurrency`` requests (the start-up wave)
are left out of the statistics.

Figures: TTFT from a request's arrival to its first token; TPOT the mean gap between its later
tokens; p50 and p90 over the requests measured, ms.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from kiln.cost_model.estimate import Estimate, Term
from kiln.cost_model.hardware import Hardware
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism, replica_batch
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import ModelConfig

CHUNK_TOKENS = 8192
"""Token budget of one step (vLLM's and SGLang's usual chunked-prefill budget)."""
MEASURED_REQUESTS = 16
"""Requests measured after the start-up wave, at least (4 x concurrency when more)."""
MAX_STEPS = 100_000
"""Steps simulated at most (the requests finished by then are the figures)."""


@dataclass(frozen=True)
class ServingStats:
    """TTFT and TPOT percentiles in ms over ``requests`` requests; ``tokens_per_s``: output
    tokens/s of the replica over the measured span; ``mean_running``: sequences decoding in an
    average step; ``steps`` simulated."""

    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    requests: int
    mean_running: float
    steps: int


@dataclass(frozen=True)
class StepTimes:
    """A replica's step time as the serving model reads it: ``fixed_ms`` (kernels and
    communication latency), ``decode_ms(n)`` the rest of a decode step at ``n`` running and
    ``prefill_ms(tokens)`` the rest of a prefill of ``tokens``."""

    fixed_ms: float
    decode_ms: Callable[[int], float]
    prefill_ms: Callable[[int], float]

    def step_ms(self, running: int, prompt_tokens: int) -> float:
        """One mixed step: ``fixed + max(decode part, prefill part)``."""
        dec = self.decode_ms(running) if running else 0.0
        pre = self.prefill_ms(prompt_tokens) if prompt_tokens else 0.0
        return self.fixed_ms + max(dec, pre)


_FIXED_TERMS = (
    "kernel_overhead_ms",
    "tp_allreduce_ms",
    "ep_alltoall_ms",
    "moe_gather_ms",
    "dcp_merge_ms",
    "pp_send_ms",
)


def _fixed_ms(est: Estimate, phase: str) -> float:
    """Kernel overhead and communication of one pass (what does not overlap memory or math)."""
    return sum(est.term(f"{phase}.{n}").value for n in _FIXED_TERMS)


def step_times(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    plan: Parallelism,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
) -> StepTimes:
    """Step times of one replica of ``plan`` at ``point``'s context, from roofline estimates at
    batch sizes of powers of two (linear between them) and at prompt lengths of the chunk
    sizes a step can carry (linear between them)."""
    one = replace(plan, dp=1)
    top = replica_batch(point.batch_size, plan.dp)
    sizes = sorted({1, top, *(2**k for k in range(int(math.log2(max(1, top))) + 1))})
    fixed = _fixed_ms(
        estimate(cfg, hw, replace(point, batch_size=1), one, weight_dtype, act_dtype), "decode"
    )
    dec = {}
    for b in sizes:
        e = estimate(cfg, hw, replace(point, batch_size=b), one, weight_dtype, act_dtype)
        dec[b] = e.tpot_ms - _fixed_ms(e, "decode")
    chunks = sorted({1, 64, 256, 1024, 4096, CHUNK_TOKENS})
    pre = {}
    for c in chunks:
        e = estimate(cfg, hw, replace(point, batch_size=1, isl=c), one, weight_dtype, act_dtype)
        pre[c] = e.ttft_ms - _fixed_ms(e, "prefill")
    return StepTimes(fixed, _interpolate(dec), _interpolate(pre))


def _interpolate(table: dict[int, float]) -> Callable[[int], float]:
    xs = sorted(table)

    def f(x: int) -> float:
        if x <= xs[0]:
            return table[xs[0]] * x / xs[0]
        for lo, hi in itertools.pairwise(xs):
            if x <= hi:
                return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
        lo, hi = xs[-2], xs[-1]  # beyond the table: extend its last slope
        return table[hi] + (table[hi] - table[lo]) * (x - hi) / (hi - lo)

    return f


@dataclass
class _Request:
    arrival_ms: float
    prompt_left: int
    first_ms: float = -1.0
    last_ms: float = 0.0


def simulate(
    times: StepTimes, *, concurrency: int, isl: int, osl: int, chunk: int = CHUNK_TOKENS
) -> ServingStats:
    """The closed-loop serving model of the module docs for one replica (at most
    :data:`MAX_STEPS` steps)."""
    users = max(1, concurrency)
    isl, osl, chunk = max(1, isl), max(1, osl), max(1, chunk)
    wanted = users + max(MEASURED_REQUESTS, 4 * users)
    now, sent, steps, running, joining, running_sum = 0.0, users, 0, 0, 0, 0
    start_ms, start_tokens, tokens_out = -1.0, 0, 0
    waiting: deque[_Request] = deque(_Request(0.0, isl) for _ in range(users))
    decoding: list[tuple[int, int, _Request]] = []  # (last step, arrival order, request)
    done: list[_Request] = []
    while len(done) < wanted and not (steps >= MAX_STEPS and len(done) > users):
        running += joining  # first token last step: decoding from this one
        joining = 0
        budget = chunk - running
        prompt_tokens, finishing = 0, []
        for r in waiting:
            if budget <= 0:
                break
            take = min(budget, r.prompt_left)
            r.prompt_left -= take
            budget -= take
            prompt_tokens += take
            if r.prompt_left == 0:
                finishing.append(r)
        now += times.step_ms(running, prompt_tokens)
        steps += 1
        running_sum += running
        tokens_out += running + len(finishing)
        finished = 0
        for r in finishing:
            waiting.popleft()  # first come, first served: the finishing are at the front
            r.first_ms = r.last_ms = now
            if osl == 1:
                done.append(r)
                finished += 1
            else:
                heapq.heappush(decoding, (steps + osl - 1, len(done) + len(decoding), r))
                joining += 1
        while decoding and decoding[0][0] <= steps:
            r = heapq.heappop(decoding)[2]
            r.last_ms = now
            done.append(r)
            running -= 1
            finished += 1
        if start_ms < 0 and len(done) >= users:  # the start-up wave is over
            start_ms, start_tokens = now, tokens_out
        for _ in range(finished):
            if sent < wanted:  # a user whose request finished sends the next one
                waiting.append(_Request(now, isl))
                sent += 1
    measured = done[users:wanted]
    ttft = sorted(r.first_ms - r.arrival_ms for r in measured)
    tpot = sorted((r.last_ms - r.first_ms) / (osl - 1) for r in measured) if osl > 1 else [0.0]
    span_ms = now - start_ms if start_ms >= 0 else now
    return ServingStats(
        tokens_per_s=(tokens_out - start_tokens) / (span_ms / 1e3) if span_ms > 0 else 0.0,
        ttft_p50_ms=_pct(ttft, 0.5),
        ttft_p90_ms=_pct(ttft, 0.9),
        tpot_p50_ms=_pct(tpot, 0.5),
        tpot_p90_ms=_pct(tpot, 0.9),
        requests=len(measured),
        mean_running=running_sum / max(1, steps),
        steps=steps,
    )


def _pct(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ascending values."""
    i = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[i]


def serve(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    plan: Parallelism,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
) -> ServingStats:
    """The serving model of ``plan`` at ``point``: ``point.batch_size`` users over the DP
    replicas, each sending ``point.isl``-token prompts for ``point.osl`` tokens."""
    times = step_times(cfg, hw, point, plan, weight_dtype, act_dtype)
    per_replica = replica_batch(point.batch_size, plan.dp)
    return simulate(times, concurrency=per_replica, isl=point.isl, osl=point.osl)


def serving_terms(est: Estimate) -> list[Term]:
    """The serving model's figures of ``est`` as Explain terms (none where it did not run)."""
    sv = est.serving
    if not isinstance(sv, ServingStats):
        return []
    how = (
        f"closed loop of {replica_batch(est.point.batch_size, est.plan.dp)} users a replica, "
        f"ISL {est.point.isl}, OSL {est.point.osl}, {CHUNK_TOKENS}-token steps; "
        f"{sv.requests} requests after the start-up wave, {sv.steps} steps"
    )
    return [
        Term("serving.ttft_p50_ms", sv.ttft_p50_ms, "ms", how),
        Term("serving.ttft_p90_ms", sv.ttft_p90_ms, "ms", how),
        Term("serving.tpot_p50_ms", sv.tpot_p50_ms, "ms", how),
        Term("serving.tpot_p90_ms", sv.tpot_p90_ms, "ms", how),
        Term("serving.tokens_per_s", est.served_tokens_per_s, "tokens/s", "all replicas"),
        Term("serving.mean_running", sv.mean_running, "sequences", "decoding in a mean step"),
    ]
