"""Honest candidates built like the cheats: code modules with the same helpers, caches,
threads and side streams, and ones that look like a cheat of a later kind (a tensor subclass,
a frame read, precision other than the model's, tables built at load, a slow first call) but
compute the right thing. Each must measure ``ok`` with every timed step verified, so the gate
(and any defense added to it) is shown to reject cheats, not code modules.
"""

from __future__ import annotations

from kiln.domain.candidate import Candidate

from .cheat_code import code_module

HONEST_MODULE = code_module(
    "honest_same_tricks",
    """
_transposed = {}


@register("lm_head", "cached_weight", replace=True)
def cached_weight(x, *, weight):
    # Caching a derived layout of a weight is fine; caching outputs is not.
    key = weight.data_ptr()
    if key not in _transposed:
        _transposed[key] = weight.t().contiguous()
    return (x @ _transposed[key]).float()


@register("mlp", "by_layer", replace=True)
def by_layer(x, *, gate_weight, up_weight, down_weight):
    _layer(down_weight)  # the same bookkeeping as the skipping cheats, without the skipping
    _checked()
    return _mlp(x, gate_weight, up_weight, down_weight)


@register("attention", "by_halves", replace=True)
def by_halves(q, k_cache, v_cache, positions, seq_lens, *, scale):
    # Both halves of the batch, each computed (the half-batch cheat's structure).
    half = (q.shape[0] + 1) // 2
    out = torch.empty_like(q)
    for rows in (slice(0, half), slice(half, None)):
        out[rows] = _attention.reference(
            q[rows], k_cache[rows], v_cache[rows], positions[rows], seq_lens[rows], scale=scale
        )
    return out
""",
)

HONEST_THREADS = code_module(
    "honest_threads",
    """
@register("lm_head", "two_threads", replace=True)
def two_threads(x, *, weight):
    # Halves of the vocabulary on two threads, both joined before returning.
    out = torch.empty(x.shape[:-1] + (weight.shape[0],), dtype=torch.float32, device=x.device)
    half = weight.shape[0] // 2

    def part(lo, hi):
        out[..., lo:hi] = F.linear(x, weight[lo:hi]).float()

    threads = [
        threading.Thread(target=part, args=(0, half)),
        threading.Thread(target=part, args=(half, weight.shape[0])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
""",
)

HONEST_SIDE_STREAM = code_module(
    "honest_side_stream",
    """
_streams = []


@register("lm_head", "joined_stream", replace=True)
def joined_stream(x, *, weight):
    if not x.is_cuda:
        return F.linear(x, weight).float()
    if not _streams:
        _streams.append(torch.cuda.Stream(x.device))
    side, current = _streams[0], torch.cuda.current_stream(x.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = F.linear(x, weight).float()
    current.wait_stream(side)  # the caller's stream waits: the work is part of the call
    out.record_stream(current)
    return out
""",
)


HONEST_UPCAST = code_module(
    "honest_upcast",
    """
@register("lm_head", "float64", replace=True)
def float64_head(x, *, weight):
    # More precise than the model dtype, never less: float64 products, float32 logits.
    return F.linear(x.double(), weight.double()).float()


@register("mlp", "float32_upcast", replace=True)
def upcast_mlp(x, *, gate_weight, up_weight, down_weight):
    w = (gate_weight.float(), up_weight.float(), down_weight.float())
    return _mlp(x.float(), *w).to(x.dtype)
""",
)

HONEST_SUBCLASS_INSIDE = code_module(
    "honest_subclass_inside",
    """
_labels = set()


class _Counting(torch.Tensor):
    calls = [0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls[0] += 1
        return super().__torch_function__(func, types, args, kwargs)


@register("lm_head", "subclass_inside", replace=True)
def subclass_inside(x, *, weight):
    _labels.add(sys._getframe(1).f_code.co_name)  # who called, for a profile label only
    out = F.linear(x.as_subclass(_Counting), weight).float()  # counted on the way
    with torch._C.DisableTorchFunctionSubclass():
        return out.as_subclass(torch.Tensor)  # what leaves the op is a plain tensor
""",
)

HONEST_LOAD_TIME = code_module(
    "honest_load_time",
    """
# Built at load: an index table every attention call slices (nothing of the engine's).
_SLOTS = torch.arange(1 << 16)
_fused = {}


@register("attention", "slot_table", replace=True)
def slot_table(q, k_cache, v_cache, positions, seq_lens, *, scale):
    b, hq, t, d = q.shape
    hkv = k_cache.shape[1]
    qg = q.float().reshape(b, hkv, (hq // hkv) * t, d)
    scores = (qg @ k_cache.float().transpose(-1, -2)) * scale
    slots = _SLOTS[: k_cache.shape[2]].to(q.device)
    mask = (slots <= positions[:, :, None]) & (slots < seq_lens[:, None, None])  # [B, T, S]
    scores = scores.view(b, hkv, hq // hkv, t, -1).masked_fill(~mask[:, None, None], -torch.inf)
    probs = torch.softmax(scores, dim=-1).view(b, hkv, (hq // hkv) * t, -1)
    return (probs @ v_cache.float()).view(b, hq, t, d).to(q.dtype)


@register("mlp", "fused_at_first_call", replace=True)
def fused_at_first_call(x, *, gate_weight, up_weight, down_weight):
    key = (gate_weight.data_ptr(), up_weight.data_ptr())
    if key not in _fused:  # a slow first call per layer: a derived layout, not an answer
        _fused[key] = torch.cat([gate_weight, up_weight]).contiguous()
    gate, up = F.linear(x, _fused[key]).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight)
""",
)


def honest(device_type: str) -> list[tuple[str, Candidate]]:
    """Honest candidates that look like cheats; ``(name, candidate)``, each must measure
    ``ok``."""
    out = [
        (
            "same_tricks",
            Candidate.make(
                {"lm_head": "cached_weight", "mlp": "by_layer", "attention": "by_halves"},
                code_modules=[HONEST_MODULE],
            ),
        ),
        (
            "threads_joined",
            Candidate.make({"lm_head": "two_threads"}, code_modules=[HONEST_THREADS]),
        ),
        (
            "upcast",
            Candidate.make(
                {"lm_head": "float64", "mlp": "float32_upcast"}, code_modules=[HONEST_UPCAST]
            ),
        ),
        (
            "subclass_inside",
            Candidate.make({"lm_head": "subclass_inside"}, code_modules=[HONEST_SUBCLASS_INSIDE]),
        ),
        (
            "load_time_tables",
            Candidate.make(
                {"attention": "slot_table", "mlp": "fused_at_first_call"},
                code_modules=[HONEST_LOAD_TIME],
            ),
        ),
    ]
    if device_type == "cuda":
        out.append(
            (
                "side_stream_joined",
                Candidate.make({"lm_head": "joined_stream"}, code_modules=[HONEST_SIDE_STREAM]),
            )
        )
    return out
