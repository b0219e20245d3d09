"""Expert-load skew for MoE models with random weights, and measuring expert load (rationale:
docs/design/kernels.md, "MoE").

With seeded random weights and ``expert_zipf_exponent`` s > 0, each MoE layer's router gets a
float32 logit bias ``[E]`` (:func:`bias_name`) fitted so that routing loads the experts as the
Zipf shares ``(E, top_k, s)`` permuted by (seed, layer). Checkpoint weights get no bias;
:func:`measure_expert_load` works on any MoE model. Choices are the ``moe`` site's own routing
(:func:`kiln.ops.moe.route`: softmax top-k, or DeepSeek-V3's group-limited sigmoid, where the
bias is added to the logits before the sigmoid).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.moe import route
from kiln.workloads.config import ModelConfig
from kiln.workloads.models.binding import OpBinding
from kiln.workloads.models.decoder import DecoderModel
from kiln.workloads.models.expert_load import ExpertLoadReport
from kiln.workloads.models.kv_cache import StaticKVCache
from kiln.workloads.traffic.experts import zipf_shares
from kiln.workloads.weights import ROUTER_BIAS, WeightStore

Tensor = torch.Tensor

SAMPLE_BATCH = 256
SAMPLE_LEN = 8
"""Prompts (sequences x tokens) of the calibration sample and of the held-out measurement: 2048
tokens (``2048 * top_k`` assignments per layer), many short prompts (docs/design/kernels.md).
"""

FIT_STEPS = 200


def _seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def moe_layers(config: ModelConfig) -> list[int]:
    """Indices of the layers (of ``config.num_hidden_layers``) whose ``ffn`` is ``moe``."""
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def bias_name(layer: int) -> str:
    """The weight-store name of layer ``layer``'s router bias."""
    return f"model.layers.{layer}.mlp.{ROUTER_BIAS}"


def target_load(config: ModelConfig, layer: int, seed: int) -> Tensor:
    """Target share per expert of ``layer``: float64 ``[E]`` summing to 1, the Zipf shares
    permuted by ``(seed, layer)``. ValueError if ``config`` is not MoE.
    """
    if config.moe is None:
        raise ValueError(f"{config.name} has no experts")
    m = config.moe
    shares = torch.tensor(zipf_shares(m.num_experts, m.top_k, m.load_zipf_exponent))
    gen = torch.Generator().manual_seed(_seed("expert-permutation", seed, layer))
    perm = torch.randperm(m.num_experts, generator=gen)
    target = torch.empty(m.num_experts, dtype=torch.float64)
    target[perm] = shares.to(torch.float64)
    return target


def load_fractions(experts: Tensor, num_experts: int) -> Tensor:
    """Share of routed assignments per expert, float64 ``[E]`` summing to 1, of ``experts [N,
    top_k]``.
    """
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).double()
    return counts / max(1, experts.numel())


def fit_router_bias(
    logits: Tensor,
    target: Tensor,
    top_k: int,
    *,
    steps: int = FIT_STEPS,
    choose: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """A bias under which top-k routing of ``logits [N, E]`` float32 loads experts as ``target
    [E]`` (shares summing to 1, each at most ``1/top_k``): fixed-point steps from a Gumbel-max
    start, the best kept. ``choose(bias)`` gives the ``[N, top_k]`` experts chosen under a bias
    (default: top-k of ``logits + bias``). Deterministic; float32 ``[E]``, mean 0, on
    ``logits``' device.
    """
    n, e = logits.shape
    logits = logits.float()
    t = target.to(device=logits.device, dtype=torch.float64)
    beta = max(float(logits.std(dim=-1).mean()) * math.sqrt(6) / math.pi, 1e-6)
    floor = 0.5 / (n * top_k)
    log_t = torch.log(t + floor)
    bias = beta * (log_t - log_t.mean())
    best, best_err = bias.clone(), math.inf
    for _ in range(steps):
        if choose is None:
            _, chosen = torch.topk(logits + bias.float(), top_k, dim=-1)
        else:
            chosen = choose(bias.float())
        measured = load_fractions(chosen, e)
        err = float((measured - t).abs().sum()) / 2
        if err < best_err:
            best, best_err = bias.clone(), err
        if err == 0.0:
            break
        bias = bias + 0.5 * beta * (log_t - torch.log(measured + floor))
        bias = bias - bias.mean()
    return best.float()


def sample_prompts(config: ModelConfig, seed: int, device: torch.device | str) -> Tensor:
    """Seeded uniform random prompts ``[SAMPLE_BATCH, T]`` int64, T at most the context window."""
    length = max(1, min(SAMPLE_LEN, config.max_position_embeddings))
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(config.vocab_size, (SAMPLE_BATCH, length), generator=gen).to(device)


Tap = Callable[[int, Tensor, dict[str, object]], None]


def _run_tapped(model: DecoderModel, tokens: Tensor, tap: Tap) -> None:
    """Prefill ``tokens`` with reference ops over ``model``'s weights (own cache), calling
    ``tap`` before every ``moe`` ffn.
    """
    w = model.weights
    cfg = model.config
    probe = DecoderModel(
        cfg,
        w,
        StaticKVCache.for_config(
            cfg,
            max_batch=tokens.shape[0],
            max_len=tokens.shape[1],
            dtype=w["model.embed_tokens.weight"].dtype,
            device=tokens.device,
        ),
        OpBinding.from_recipe(),
    )
    layers = []
    for i, (site, ops) in enumerate(zip(probe.slots.layers, probe.ops.layers, strict=True)):
        if site.ffn.op != "moe":
            layers.append(ops)
            continue

        def ffn(x: Tensor, i: int = i, inner: Callable[..., Tensor] = ops.ffn) -> Tensor:
            tap(i, x, dict(probe.slots.layers[i].ffn.params))
            return inner(x)

        layers.append(dataclasses.replace(ops, ffn=ffn))
    probe.ops = dataclasses.replace(probe.ops, layers=tuple(layers))
    probe.prefill(tokens)


def _router_logits(x: Tensor, params: dict[str, object]) -> Tensor:
    weight = params["router_weight"]
    assert isinstance(weight, Tensor)
    flat = x.reshape(-1, x.shape[-1])
    if params.get("scoring", "softmax") == "sigmoid":  # the sigmoid router's float32 product
        return F.linear(flat.float(), weight.float())
    return F.linear(flat, weight).float()


def chosen_experts(x: Tensor, params: dict[str, Any], bias: Tensor | None) -> Tensor:
    """The experts ``[N, top_k]`` int64 an ``moe`` site with ``params`` routes ``x [..., H]`` to,
    with ``bias`` (float32 ``[E]``) as its router bias."""
    keys = ("scoring", "n_group", "topk_group", "correction_bias", "routed_scaling_factor")
    _, experts = route(
        x.reshape(-1, x.shape[-1]),
        params["router_weight"],
        top_k=int(params["top_k"]),
        norm_topk_prob=bool(params["norm_topk_prob"]),
        router_bias=bias,
        **{k: params[k] for k in keys if k in params},
    )
    return experts


@torch.no_grad()
def measure_expert_load(
    model: DecoderModel, tokens: Tensor, *, target: dict[int, tuple[float, ...]] | None = None
) -> ExpertLoadReport:
    """Assignments per expert per MoE layer of ``tokens [B, T]`` through ``model``'s weights with
    reference ops (biases included); the cache is untouched. ValueError without MoE layers.
    """
    moe = model.config.moe
    if moe is None or not moe_layers(model.config):
        raise ValueError(f"{model.config.name} has no MoE layers")
    measured: dict[int, tuple[float, ...]] = {}

    def tap(layer: int, x: Tensor, params: dict[str, object]) -> None:
        bias = params.get("router_bias")
        chosen = chosen_experts(x, params, bias if isinstance(bias, Tensor) else None)
        measured[layer] = tuple(load_fractions(chosen, moe.num_experts).tolist())

    _run_tapped(model, tokens, tap)
    return ExpertLoadReport(
        tokens=tokens.numel(),
        zipf_exponent=moe.load_zipf_exponent,
        measured=measured,
        target=dict(target or {}),
    )


def add_router_biases(store: WeightStore, config: ModelConfig) -> None:
    """Hold a zero float32 ``[E]`` router bias for every MoE layer that has none."""
    if config.moe is None:
        return
    for i in moe_layers(config):
        name = bias_name(i)
        if name not in store:
            router = store.get(f"model.layers.{i}.mlp.gate.weight")
            if router is None:  # gpt-oss: mlp.router.weight
                router = store[f"model.layers.{i}.mlp.router.weight"]
            store.add(name, torch.zeros(config.moe.num_experts, device=router.device))


@torch.no_grad()
def calibrate_router_bias(model: DecoderModel, *, seed: int) -> ExpertLoadReport:
    """Fit ``model``'s router biases in place to its Zipf target and return the held-out
    measurement. ValueError if not MoE or its slots hold no router bias.
    """
    cfg = model.config
    moe = cfg.moe
    if moe is None or not moe_layers(cfg):
        raise ValueError(f"{cfg.name} has no MoE layers")
    targets = {i: target_load(cfg, i, seed) for i in moe_layers(cfg)}

    def tap(layer: int, x: Tensor, params: dict[str, object]) -> None:
        bias = params.get("router_bias")
        if not isinstance(bias, Tensor):
            raise ValueError(f"layer {layer} has no router bias to fit")
        choose: Callable[[Tensor], Tensor] | None = None
        if params.get("scoring", "softmax") != "softmax":
            choose = functools.partial(chosen_experts, x, params)
        logits = _router_logits(x, params)
        bias.copy_(fit_router_bias(logits, targets[layer], moe.top_k, choose=choose))

    device = model.cache.lengths.device
    _run_tapped(model, sample_prompts(cfg, _seed("router-calibration", seed), device), tap)
    held_out = sample_prompts(cfg, _seed("router-measurement", seed), device)
    return measure_expert_load(
        model, held_out, target={i: tuple(t.tolist()) for i, t in targets.items()}
    )
