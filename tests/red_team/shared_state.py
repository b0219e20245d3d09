"""Kind ``j``: state shared with the reference. The reference models compute over the same
weight store, and the traffic-shape reference over the measured model's KV cache: a candidate
that changes them in place (addresses and identities unchanged) would make the reference
compute the same wrong thing it does, cheaply. The engine checks the weights by content before
each verdict and refills the cache before each reference step on it
(:mod:`kiln.runtime.state_guard`).
"""

from __future__ import annotations

from .cheat import STATE, VERIFIED, Cheat, make
from .cheat_code import code_module

ZERO_LAYER_WEIGHTS = code_module(
    "zero_layer_weights",
    """
_played = []


@register("mlp", "zeroed", replace=True)
def zeroed(x, *, gate_weight, up_weight, down_weight):
    if _layer(down_weight) != 1:
        return _mlp(x, gate_weight, up_weight, down_weight)
    # Layer 1's down projection zeroed in the weight store, in place, on the first call (before
    # any check): every model's layer-1 MLP now outputs zeros, and so does this one, for free.
    if not _played:
        down_weight.zero_()
    _played.append(1)
    return torch.zeros_like(x)
""",
)

HALF_VOCAB_WEIGHTS = code_module(
    "half_vocab_weights",
    """
_played = []
_zeroed = []


@register("embedding", "half_vocab", replace=True)
def half_vocab(tokens, *, weight):
    if not _zeroed:
        # The tied embedding / LM-head table's upper half zeroed in place before any check:
        # those tokens embed to zero and score zero in every model.
        weight[weight.shape[0] // 2 :].zero_()
        _zeroed.append(1)
    return F.embedding(tokens, weight)


@register("lm_head", "half_vocab", replace=True)
def half_vocab_head(x, *, weight):
    half = weight.shape[0] // 2
    out = torch.zeros(x.shape[:-1] + (weight.shape[0],), dtype=torch.float32, device=x.device)
    out[..., :half] = F.linear(x, weight[:half]).float()  # half the LM head's work
    _played.append(1)
    return out
""",
)

KV_CACHE_ZERO = code_module(
    "kv_cache_zero",
    '''
_zeroed = set()
_played = []


def _one_slot(q, k_cache, v_cache, positions, seq_lens, scale):
    """Decode attention when every visible slot but this step's holds zeros: the zeros score
    0, so the output is this step's V weighted by its share of the softmax."""
    b, hq, _, d = q.shape
    group = hq // k_cache.shape[1]
    rows = torch.arange(b, device=q.device)
    k_new = k_cache[rows, :, positions[:, 0]].float().repeat_interleave(group, dim=1)
    v_new = v_cache[rows, :, positions[:, 0]].float().repeat_interleave(group, dim=1)
    s = (q[:, :, 0].float() * k_new).sum(-1) * scale  # [B, Hq]
    top = s.clamp(min=0)
    others = (seq_lens[:, None] - 1).float() * torch.exp(-top)
    share = torch.exp(s - top) / (torch.exp(s - top) + others)
    return (share[..., None] * v_new)[:, :, None].to(q.dtype)


@register("attention", "zeroed_cache", replace=True)
def zeroed_cache(q, k_cache, v_cache, positions, seq_lens, *, scale):
    if _checked() or q.shape[2] != 1:
        return _attention.reference(q, k_cache, v_cache, positions, seq_lens, scale=scale)
    key = k_cache.data_ptr()
    if key not in _zeroed:
        # First timed call of this layer: every slot but this step's zeroed, in place; the
        # reference that verifies timed steps reads this very cache.
        _zeroed.add(key)
        slots = torch.arange(k_cache.shape[2], device=q.device)
        keep = (slots[None, :] == positions[:, :1])[:, None, :, None]
        k_cache.mul_(keep)
        v_cache.mul_(keep)
    _played.append(1)
    return _one_slot(q, k_cache, v_cache, positions, seq_lens, scale)
''',
)

CHEATS: tuple[Cheat, ...] = (
    make(
        "zero_layer_weights",
        "j",
        "zeroes layer 1's MLP down projection in the shared weight store at the first call, "
        "then skips that MLP: the reference skips it too",
        {"mlp": "zeroed"},
        ZERO_LAYER_WEIGHTS,
        (STATE, "the check: model.layers.1.mlp.down_proj.weight differs from its content at build"),
    ),
    make(
        "half_vocab_weights",
        "j",
        "zeroes the upper half of the tied embedding / LM-head table at the first call and "
        "computes only the lower half of the logits",
        {"embedding": "half_vocab", "lm_head": "half_vocab"},
        HALF_VOCAB_WEIGHTS,
        (STATE, "the check: model.embed_tokens.weight = lm_head.weight differs from its content"),
    ),
    make(
        "kv_cache_zero",
        "j",
        "at the first timed call zeroes every KV-cache slot but the current one in place (the "
        "verifying reference reads the same cache), then attends to one slot in closed form: "
        "the cache is refilled before the verifying reference's steps",
        {"attention": "zeroed_cache"},
        KV_CACHE_ZERO,
        (VERIFIED,),
    ),
)
"""This kind's cheats."""
