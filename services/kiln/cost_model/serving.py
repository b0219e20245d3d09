"""A serving model: TTFT and TPOT as distributions under continuous batching with chunked
prefill, from a plan's roofline step times.

Load: a closed loop of ``concurrency`` users per DP replica (``ceil(B / dp)``), each sending its
next request (``isl`` prompt tokens, ``osl`` output tokens) when the last one finishes -- the way
serving benchmarks drive an engine at a fixed concurrency. Scheduler (vLLM V1 / SGLang style):
every step decodes one token for each running sequence and spends the rest of a token budget
of ``chunk`` (at least the running sequences) on prompts, first come first served, a prompt's
first token coming with the step that finishes its prefill. Step time, the roofline of one
mixed forward: ``fixed + max(decode memory time at n running (the weights at least), decode
math + the prompt chunks' math)``; a chunk ``[s, s + t)`` of a prompt costs its math with
attention over the ``s`` tokens before it. All read off the plan's estimates
(:func:`step_times`). The first ``concurrency`` requests (the start-up wave) are left out of
the latencies, and the throughput is counted from the end of that wave to the last request's
arrival (the drain, with no new prompts, is not the load).

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
from kiln.cost_model.evidence import NO_EVIDENCE, Evidence
from kiln.cost_model.hardware import Hardware
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism, replica_batch
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import ModelConfig

CHUNK_TOKENS = 8192
"""Token budget of one step (vLLM's and SGLang's usual chunked-prefill budget)."""
MEASURED_REQUESTS = 16
"""Requests measured after the start-up wave, at least (4 x concurrency when more)."""
MAX_STEPS = 20_000
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
    """A replica's step time as the serving model reads it, ms: ``fixed_ms`` (kernels and
    communication latency), ``decode_memory_ms(n)`` and ``decode_compute_ms(n)`` of a decode
    step at ``n`` running, and ``prompt_compute_ms(L)`` the math of a prompt's first ``L``
    tokens (attention over them included), so that a chunk ``[s, s + t)`` costs
    ``prompt_compute_ms(s + t) - prompt_compute_ms(s)``."""

    fixed_ms: float
    decode_memory_ms: Callable[[int], float]
    decode_compute_ms: Callable[[int], float]
    prompt_compute_ms: Callable[[int], float]

    def step_ms(self, running: int, prompt_ms: float) -> float:
        """One mixed step, the roofline of one forward: ``fixed + max(memory of the decode
        batch (the weights at least), its math + the prompts' math)``."""
        memory = self.decode_memory_ms(max(1, running))
        math_ms = (self.decode_compute_ms(running) if running else 0.0) + prompt_ms
        return self.fixed_ms + max(memory, math_ms)


def step_times(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    plan: Parallelism,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
    evidence: Evidence = NO_EVIDENCE,
) -> StepTimes:
    """Step times of one replica of ``plan`` at ``point``'s context, from estimates at batch
    sizes of powers of two and prompt lengths up to ``point.isl`` (linear between them). With
    a microbenchmark table (``evidence``) the decode "memory" time is the step's measured op
    time and a prompt's math its measured prefill ops; with a calibration the decode parts and
    the launches are multiplied by its factor."""
    one = replace(plan, dp=1)
    top = replica_batch(point.batch_size, plan.dp)
    sizes = sorted({1, top, *(2**k for k in range(int(math.log2(max(1, top))) + 1))})
    ev = evidence
    first = estimate(cfg, hw, replace(point, batch_size=1), one, weight_dtype, act_dtype, ev)
    factor = _value(first, "decode.calibration_factor", 1.0)
    launch = first.term("decode.kernel_overhead_ms").value
    fixed = first.term("decode.fixed_ms").value + (factor - 1.0) * launch
    memory, compute = {}, {}
    for b in sizes:
        e = estimate(cfg, hw, replace(point, batch_size=b), one, weight_dtype, act_dtype, ev)
        ops = _value(e, "decode.measured_ops_ms", 0.0)
        memory[b] = factor * (ops or e.term("decode.memory_time_ms").value)
        compute[b] = factor * e.term("decode.compute_time_ms").value
    longest = max(1, point.isl)
    lengths = sorted(
        {1, 64, 256, 1024, 4096, longest, *(2**k for k in range(13, 25) if 2**k < longest)}
    )
    prompt = {}
    for n in lengths:
        e = estimate(cfg, hw, replace(point, batch_size=1, isl=n), one, weight_dtype, act_dtype, ev)
        prompt[n] = (
            _value(e, "prefill.measured_ops_ms", 0.0) or e.term("prefill.compute_time_ms").value
        )
    return StepTimes(fixed, _interpolate(memory), _interpolate(compute), _interpolate(prompt))


def _value(est: Estimate, name: str, default: float) -> float:
    """The term's value, ``default`` when the estimate has none of that name."""
    try:
        return est.term(name).value
    except KeyError:
        return default


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
    prompt_done: int = 0
    first_ms: float = -1.0
    first_step: int = 0
    last_ms: float = 0.0


def simulate(
    times: StepTimes, *, concurrency: int, isl: int, osl: int, chunk: int = CHUNK_TOKENS
) -> ServingStats:
    """The closed-loop serving model of the module docs for one replica. The step budget is
    at least ``concurrency`` tokens (engines size it to decode every running sequence); at most
    :data:`MAX_STEPS` steps, the figures then coming from the requests served so far."""
    users = max(1, concurrency)
    isl, osl, chunk = max(1, isl), max(1, osl), max(chunk, users)
    wanted = users + max(MEASURED_REQUESTS, 4 * users)
    now, sent, steps, running, joining, running_sum = 0.0, users, 0, 0, 0, 0
    start_ms, start_tokens, end_ms, end_tokens, tokens_out = -1.0, 0, -1.0, 0, 0
    waiting: deque[_Request] = deque(_Request(0.0, isl) for _ in range(users))
    decoding: list[tuple[int, int, _Request]] = []  # (last step, arrival order, request)
    done: list[_Request] = []
    while len(done) < wanted and steps < MAX_STEPS:
        running += joining  # first token last step: decoding from this one
        joining = 0
        budget = chunk - running
        prompt_ms, finishing = 0.0, []
        for r in waiting:
            if budget <= 0:
                break
            take = min(budget, r.prompt_left)
            start = r.prompt_done
            r.prompt_left -= take
            r.prompt_done += take
            budget -= take
            prompt_ms += times.prompt_compute_ms(start + take) - times.prompt_compute_ms(start)
            if r.prompt_left == 0:
                finishing.append(r)
        now += times.step_ms(running, prompt_ms)
        steps += 1
        running_sum += running
        tokens_out += running + len(finishing)
        finished = 0
        for r in finishing:
            waiting.popleft()  # first come, first served: the finishing are at the front
            r.first_ms = r.last_ms = now
            r.first_step = steps
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
        if end_ms < 0 and sent >= wanted:  # the last request is in: the drain is not load
            end_ms, end_tokens = now, tokens_out
    ttft, tpot = _latencies(done, decoding, users, wanted, osl, now, steps)
    if start_ms < 0:
        start_ms, start_tokens = 0.0, 0
    if end_ms <= start_ms:
        end_ms, end_tokens = now, tokens_out
    span_ms = end_ms - start_ms
    return ServingStats(
        tokens_per_s=(end_tokens - start_tokens) / (span_ms / 1e3) if span_ms > 0 else 0.0,
        ttft_p50_ms=_pct(ttft, 0.5),
        ttft_p90_ms=_pct(ttft, 0.9),
        tpot_p50_ms=_pct(tpot, 0.5),
        tpot_p90_ms=_pct(tpot, 0.9),
        requests=len(ttft),
        mean_running=running_sum / max(1, steps),
        steps=steps,
    )


def _latencies(
    done: list[_Request],
    decoding: list[tuple[int, int, _Request]],
    users: int,
    wanted: int,
    osl: int,
    now: float,
    steps: int,
) -> tuple[list[float], list[float]]:
    """Sorted TTFTs and TPOTs: of the finished requests after the start-up wave; where the step
    bound came first, of every request with a first token (TPOT so far for those decoding)."""
    measured = done[users:wanted] if len(done) > users else done
    ttft = [r.first_ms - r.arrival_ms for r in measured]
    tpot = [(r.last_ms - r.first_ms) / (osl - 1) for r in measured] if osl > 1 else []
    if len(done) <= users:
        for _, _, r in decoding:
            ttft.append(r.first_ms - r.arrival_ms)
            if steps > r.first_step:
                tpot.append((now - r.first_ms) / (steps - r.first_step))
    return sorted(ttft) or [0.0], sorted(tpot) or [0.0]


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
    evidence: Evidence = NO_EVIDENCE,
) -> ServingStats:
    """The serving model of ``plan`` at ``point``: ``point.batch_size`` users over the DP
    replicas, each sending ``point.isl``-token prompts for ``point.osl`` tokens."""
    times = step_times(cfg, hw, point, plan, weight_dtype, act_dtype, evidence)
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
