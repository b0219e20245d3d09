"""Where a ``fused_decode`` step's time goes, kernel by kernel, inside CUDA graphs.

Builds a dense model (``--model``, default Llama-3.2-1B; random bf16 weights) on one CUDA device
with its KV cache at the operating point (``--batch`` sequences prefilled to ``--context``
tokens), then for each parameter set of
the ``fused_decode`` transform:

- the whole decode step captured as one CUDA graph (as the ``cuda_graph`` transform does) and
  timed over replays (median of ``--repeats`` replays, CUDA events);
- each kernel family alone, for all layers, captured as its own graph and timed the same way (so
  launch gaps inside a graph are counted as they are in the step, and Python launch overhead is
  not), with the bytes it must move and the fraction of ``--bandwidth``.

The difference between the step and the sum of the families is what the chain costs beyond its
kernels (the embedding, the cache-length update, gaps between different kernels). A step's
"of limit" is its time over the bandwidth limit's: the weights once plus the bf16 KV cache of
``--batch`` sequences at ``--context`` tokens that the attention reads (sliding and sparse layers
only what they attend), at ``--bandwidth``
(:func:`kiln.cost_model.step_bytes.decode_step_bytes_for`).

    python3 benchmarks/fused_decode_profile.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.cost_model.step_bytes import decode_step_bytes_for, weights_read_bytes
from kiln.runtime.fused_decode import FusedDecode
from kiln.workloads.config import load_config
from kiln.workloads.models import build_model

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"

PARAM_SETS: list[dict[str, str]] = [
    {},  # the measured defaults (benchmarks/RESULTS.md), pdl=2 included
    {"fused_combine": "1"},
    {"fused_combine": "1", "split_s": "64"},
    {"num_warps": "8"},
    {"block_k": "1024"},
    {"o_block_n": "2", "down_block_n": "2"},
    {"gate_up_block_n": "8", "lm_block_n": "32"},
    {"pdl": "0"},  # no programmatic dependent launch (the default is 2)
    {"pdl": "1"},
]


def graph_time_us(
    fn: Callable[[], object], repeats: int, keep: list[torch.Tensor] | None = None
) -> float:
    """Median µs of one replay of ``fn`` captured as a CUDA graph (after 2 eager warm-ups);
    with ``keep``, the captured output after the last replay is appended to it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    for _ in range(3):
        graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    if keep is not None and isinstance(result, torch.Tensor):
        keep.append(result.clone())
    return statistics.median(samples)


def families(fd: FusedDecode, batch: int) -> dict[str, tuple[Callable[[], object], int]]:
    """Each kernel family over all layers: (callable, bytes it must move)."""
    from kiln.ops.kernels.decode_attention import decode_attention
    from kiln.ops.kernels.gemv import gemv
    from kiln.ops.kernels.norm_gemv import rms_norm_gemv
    from kiln.ops.kernels.qkv_rope import rms_norm_qkv_rope

    cache = fd.model.cache
    h = fd.model.config.hidden_size
    dev, dt = cache.lengths.device, cache.k[0].dtype
    s = torch.randn(batch, h, device=dev, dtype=dt)
    pos = cache.lengths[:batch]
    seq = cache.lengths[:batch] + 1
    q = torch.randn(batch, fd.num_heads, fd.head_dim, device=dev, dtype=dt)
    attn = torch.randn(batch, fd.num_heads * fd.head_dim, device=dev, dtype=dt)
    act = torch.randn(batch, fd.model.config.intermediate_size, device=dev, dtype=dt)
    layers = fd.layers
    elem = s.element_size()
    kv_bytes = sum(
        2 * batch * fd.num_kv_heads * int(cache.lengths.max() + 1) * fd.head_dim * elem
        for _ in layers
    )

    def qkv() -> None:
        for i, layer in enumerate(layers):
            if layer.q_norm is not None or layer.k_norm is not None:  # Qwen3: product, then heads
                x = rms_norm_gemv(
                    s, layer.input_norm, layer.input_eps, layer.qkv_weight,
                    config=fd.qkv_gemv_config,
                )  # fmt: skip
                fd._prologue(i, layer, x, pos, cache)
                continue
            rms_norm_qkv_rope(
                s,
                layer.input_norm,
                layer.input_eps,
                layer.qkv_weight,
                fd.cos,
                fd.sin,
                pos,
                cache.k[i],
                cache.v[i],
                num_heads=fd.num_heads,
                num_kv_heads=fd.num_kv_heads,
                head_dim=fd.head_dim,
                config=fd.qkv_config,
            )

    def attention() -> None:
        for i, layer in enumerate(layers):
            decode_attention(
                q,
                cache.k[i][:batch],
                cache.v[i][:batch],
                seq,
                scale=layer.scale,
                config=fd.attention_config,
            )

    def o_proj() -> None:
        for layer in layers:
            gemv(attn, layer.o_weight, residual=s, config=fd.o_config)

    def gate_up() -> None:
        for layer in layers:
            rms_norm_gemv(
                s,
                layer.post_norm,
                layer.post_eps,
                layer.gate_up_weight,
                activation="silu_mul",
                config=fd.gate_up_config,
            )

    def down() -> None:
        for layer in layers:
            gemv(act, layer.down_weight, residual=s, config=fd.down_config)

    def lm_head() -> None:
        rms_norm_gemv(s, fd.final_norm, fd.final_eps, fd.lm_weight, config=fd.lm_config)

    def nbytes(name: str) -> int:
        return sum(getattr(layer, name).numel() * elem for layer in layers)

    return {
        "norm+qkv(+qk norm)+rope+cache": (qkv, nbytes("qkv_weight")),
        "attention (split-KV + combine)": (attention, kv_bytes),
        "o_proj + residual": (o_proj, nbytes("o_weight")),
        "norm+gate_up+silu": (gate_up, nbytes("gate_up_weight")),
        "down + residual": (down, nbytes("down_weight")),
        "final norm + lm_head": (lm_head, fd.lm_weight.numel() * elem),
    }


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    config = load_config(Path(args.model))
    dev = torch.device(args.device)
    model = build_model(
        config,
        dtype=torch.bfloat16,
        device=dev,
        seed=0,
        max_batch=args.batch,
        max_seq_len=args.context + args.repeats + 64,
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (args.batch, args.context), generator=gen)
    model.prefill(prompt.to(dev))
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for _, t in model.weights.items()
    }
    held = sum(storages.values())  # tied embeddings counted once
    weights = weights_read_bytes(config, held, 2, args.batch)  # an untied table: B rows read
    step = decode_step_bytes_for(config, weights, args.batch, args.context, "bfloat16")
    limit_us = step.total / args.bandwidth * 1e6
    print(
        f"{config.name}: batch {args.batch}, context {args.context}; weights {weights / 1e9:.3f}"
        f" GB + KV {step.kv / 1e9:.3f} GB -> limit {limit_us:.0f} us/step = "
        f"{step.limit_tokens_per_s(args.bandwidth):,.0f} tok/s at {args.bandwidth / 1e12:.2f} TB/s"
    )
    tokens = torch.randint(0, config.vocab_size, (args.batch, 1), device=dev)
    out = []
    first: list[torch.Tensor] = []
    for params in json.loads(args.params) if args.params else PARAM_SETS:
        fd = FusedDecode(model, params)
        saved = model.cache.state()
        logits: list[torch.Tensor] = []
        step_us = graph_time_us(lambda fd=fd: fd(tokens), args.repeats, keep=logits)
        model.cache.restore_state(saved)
        first = first or logits
        # Same replays from the same cache state: rounding differences only, where the kernels'
        # blocks differ; none at all where only the launch (pdl) differs.
        diff = (logits[0] - first[0]).abs().max().item()
        row: dict[str, Any] = {
            "params": params,
            "step_us": step_us,
            "tokens_per_s": args.batch * 1e6 / step_us,
            "fraction_of_limit": limit_us / step_us,
            "max_abs_diff_vs_first": diff,
            "families": {},
        }
        total = 0.0
        split = args.families and not fd.uses_tensor_cores(args.batch)
        for name, (fn, nbytes) in families(fd, args.batch).items() if split else []:
            us = graph_time_us(fn, args.repeats)
            model.cache.restore_state(saved)
            total += us
            row["families"][name] = {
                "us": us,
                "bytes": nbytes,
                "fraction_of_bandwidth": nbytes / (us * 1e-6) / args.bandwidth,
            }
        model.cache.restore_state(saved)
        row["families_us"] = total
        out.append(row)
        label = ",".join(f"{k}={v}" for k, v in params.items()) or "defaults"
        print(
            f"\n[{label}] step {step_us:.0f} us = {row['tokens_per_s']:.0f} tok/s "
            f"({row['fraction_of_limit']:.1%} of limit); families sum {total:.0f} us; "
            f"max |logits - first set's| {diff:.3g}"
        )
        for name, f in row["families"].items():
            print(
                f"  {name:32s} {f['us']:8.1f} us  {f['bytes'] / 1e6:8.1f} MB "
                f"{f['fraction_of_bandwidth']:6.1%}"
            )
    if args.sweep:
        sweep(model, out, args)
    print("\n=== step, best first ===")
    for r in sorted((r for r in out if "step_us" in r), key=lambda r: r["step_us"]):
        label = ",".join(f"{k}={v}" for k, v in r["params"].items()) or "defaults"
        print(
            f"{r['step_us']:8.0f} us {r['tokens_per_s']:7.0f} tok/s "
            f"{r['fraction_of_limit']:6.1%}  diff {r['max_abs_diff_vs_first']:.2g}  {label}"
        )
    return out


GEMV_GRID = [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]
ATTENTION_GRID = [
    (split, block, w, fused)
    for split in (16, 32, 64, 128)
    for block in (16, 32)
    for w in (2, 4)
    for fused in (False, True)
    if block <= split
]
FAMILY_CONFIG = {
    "norm+qkv(+qk norm)+rope+cache": "qkv_config",
    "o_proj + residual": "o_config",
    "norm+gate_up+silu": "gate_up_config",
    "down + residual": "down_config",
    "final norm + lm_head": "lm_config",
}


def sweep(model: Any, out: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Each kernel family alone over a grid of its launch parameters (in-graph times)."""
    from dataclasses import replace

    from kiln.ops.kernels.decode_attention import DecodeAttentionConfig

    saved = model.cache.state()
    best: dict[str, tuple[float, str]] = {}
    rows: list[dict[str, Any]] = []
    qk_norm = model.config.qk_norm  # the QKV product runs as a plain GEMV before the heads
    for name, attr in [*FAMILY_CONFIG.items(), ("attention (split-KV + combine)", "")]:
        if qk_norm and attr == "qkv_config":
            attr = "qkv_gemv_config"
        grid: list[tuple[int, ...]] = GEMV_GRID if attr else ATTENTION_GRID
        for a, b, w, *rest in grid:
            fd = FusedDecode(model, {})
            try:
                if attr:
                    setattr(fd, attr, replace(getattr(fd, attr), block_n=a, block_k=b, num_warps=w))
                else:
                    fd.attention_config = DecodeAttentionConfig(
                        split_s=a, block_s=b, num_warps=w, fused_combine=bool(rest[0])
                    )
                fn, _ = families(fd, args.batch)[name]
                us = graph_time_us(fn, args.repeats)
            except Exception as exc:  # a config the kernel refuses or cannot compile
                print(f"  {name} {a},{b},{w}: {type(exc).__name__}: {str(exc)[:80]}")
                continue
            finally:
                model.cache.restore_state(saved)
            label = ",".join(str(v) for v in (a, b, w, *rest))
            rows.append({"family": name, "config": label, "us": us})
            if name not in best or us < best[name][0]:
                best[name] = (us, label)
    out.append({"sweep": rows})
    print("\n=== best launch parameters per family (in-graph, all layers) ===")
    print("gemv: block_n,block_k,num_warps; attention: split_s,block_s,num_warps,fused_combine")
    for name, (us, label) in best.items():
        default = out[0]["families"].get(name, {}).get("us", float("nan"))
        print(f"  {name:32s} {us:8.1f} us (defaults {default:8.1f} us)  {label}")


def operating_point_parser(doc: str, model: str, repeats: int) -> argparse.ArgumentParser:
    """The options of the GPU step benchmarks: ``--model`` (default ``model`` under
    ../shared/data/models), ``--device``, ``--batch``, ``--context``, ``--repeats``,
    ``--bandwidth`` (bytes/s) and ``--json`` (a path for the results)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=str(SHARED / "models" / model))
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1085)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--bandwidth", type=float, default=4.26e12, help="bytes/s (H200 copy)")
    parser.add_argument("--json", default="")
    return parser


if __name__ == "__main__":
    parser = operating_point_parser(__doc__ or "", "llama-3.2-1b.json", 100)
    parser.add_argument("--sweep", action="store_true", help="per-family launch grid")
    parser.add_argument(
        "--params", default="", help='JSON list of parameter sets, e.g. \'[{}, {"pdl": "2"}]\''
    )
    parser.add_argument(
        "--no-families", dest="families", action="store_false", help="time whole steps only"
    )
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    data = main(cli)
    if cli.json:
        Path(cli.json).write_text(json.dumps(data, indent=2))
