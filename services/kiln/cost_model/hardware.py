"""The hardware catalogue: one entry per target the cost model can plan for. Every number carries
its source in ``Hardware.sources``; rates are dense tensor-core rates, capacities the
datasheets' GB as 10^9 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.common.errors import NotFound, quote

GB = 10**9
TB = 10**12
TFLOPS = 10**12

_NVLINK4 = (
    "NVLink 4 (Hopper SXM): 900 GB/s total bidirectional per GPU, i.e. 450 GB/s per direction "
    "(NVIDIA H100/H200 datasheets)"
)
_NCCL_LATENCY = (
    "assumption: ~5 us per small collective inside one NVLink/NVSwitch node, the order of "
    "NCCL's low-latency (LL) protocol at a few KiB (nccl-tests all_reduce_perf, 8 GPUs); the "
    "microbenchmark tier will measure it"
)
_PEER_LATENCY = (
    "assumption: +1.5 us per further rank (a one-shot all-reduce reads each peer over "
    "NVLink; 8 ranks: 15.5 us in all), until the microbenchmark tier measures collectives"
)
_RESERVED = (
    "assumption: 1.5 GB a GPU for the CUDA context (~0.5 GB), cuBLAS/cuDNN workspaces and "
    "NCCL buffers, until the microbenchmark tier reads it from the device after an engine's "
    "warm-up"
)
_NDR = (
    "HGX H100/H200 reference nodes: 8 ConnectX-7 NICs of 400 Gb/s InfiniBand NDR, one per GPU "
    "(NVIDIA DGX H100/H200 user guide: 8 x single-port OSFP 400 Gb/s for the compute fabric), "
    "i.e. 400 Gb/s = 50 GB/s per GPU and direction; an assumption for other clusters"
)
_NDR_B200 = (
    "DGX B200 datasheet: 8 x single-port ConnectX-7 VPI, up to 400 Gb/s InfiniBand, one per "
    "GPU, i.e. 50 GB/s per GPU and direction; an assumption for other clusters"
)
_IB_LATENCY = (
    "assumption: ~10 us for a small message between nodes over InfiniBand NDR through one "
    "switch (RDMA write a few us plus NCCL/DeepEP software overhead), until the microbenchmark "
    "tier measures it"
)
_KERNEL_OVERHEAD = (
    "derived from kiln's H200 measurement of Llama-3.2-1B at batch 1 (RESULTS.md, issue 10: "
    "0.986 ms a step at tp=1, CUDA graphs, fused decode): 0.40 ms beyond the 2.47 GB of "
    "weights at 4.26 TB/s, ~4 us a kernel for a step of ~100 kernels; an assumption for other "
    "steps until the microbenchmark tier measures launch and graph overhead"
)

_GPU_NODE: dict[str, Any] = {
    "collective_latency_s": 5e-6,
    "collective_latency_per_peer_s": 1.5e-6,
    "kernel_overhead_s": 4e-6,
    "reserved_bytes": 1_500_000_000,
    "inter_node_bandwidth_bytes_per_s": 50 * GB,
    "inter_node": "InfiniBand NDR 400 Gb/s",
    "inter_node_latency_s": 10e-6,
}
"""What the 8-GPU NVSwitch nodes of the catalogue share, assumed alike until measured."""


def _gpu_node_sources(inter_node: str) -> dict[str, str]:
    """The sources of :data:`_GPU_NODE`'s figures (``inter_node``: the link's)."""
    return {
        "collective_latency_s": _NCCL_LATENCY,
        "collective_latency_per_peer_s": _PEER_LATENCY,
        "kernel_overhead_s": _KERNEL_OVERHEAD,
        "reserved_bytes": _RESERVED,
        "inter_node_bandwidth_bytes_per_s": inter_node,
        "inter_node_latency_s": _IB_LATENCY,
    }


@dataclass(frozen=True)
class Hardware:
    """One device type and the node it comes in.

    Attributes:
        memory_bytes, memory_bandwidth_bytes_per_s: capacity and peak bandwidth.
        dense_bf16_flops, dense_fp8_flops: FLOP/s (FP8 0 when none).
        interconnect_bandwidth_bytes_per_s: per device and direction (0: no interconnect).
        max_devices_per_node: devices in one NVLink domain, the default device count.
        achievable_bandwidth_fraction: of peak, for a streaming read.
        collective_latency_s: fixed cost of one small collective or send.
        collective_latency_per_peer_s: added per further rank of a collective (a one-shot
            all-reduce reads every peer's buffer).
        kernel_overhead_s: fixed cost of one kernel of a decode step beyond its bytes and
            FLOPs (launch, ramp-up, tail).
        reserved_bytes: device memory no plan can use (driver context, library workspaces,
            communication buffers).
        inter_node_bandwidth_bytes_per_s: between nodes (the scale-out network), per device and
            direction; 0: none in the catalogue, so EP groups stay inside a node and PP sends
            are priced at the in-node link.
        inter_node: the scale-out network's name.
        inter_node_latency_s: fixed cost of one small message or collective between nodes.
    """

    name: str
    description: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    dense_bf16_flops: float
    dense_fp8_flops: float
    interconnect_bandwidth_bytes_per_s: float
    interconnect: str
    max_devices_per_node: int
    achievable_bandwidth_fraction: float = 1.0
    collective_latency_s: float = 0.0
    collective_latency_per_peer_s: float = 0.0
    kernel_overhead_s: float = 0.0
    reserved_bytes: int = 0
    inter_node_bandwidth_bytes_per_s: float = 0.0
    inter_node: str = "none"
    inter_node_latency_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def achievable_bandwidth_bytes_per_s(self) -> float:
        """Peak memory bandwidth × ``achievable_bandwidth_fraction``, bytes/s."""
        return self.memory_bandwidth_bytes_per_s * self.achievable_bandwidth_fraction

    @property
    def has_fp8(self) -> bool:
        """Whether the device has FP8 tensor cores (so an FP8 KV cache is worth searching)."""
        return self.dense_fp8_flops > 0

    def flops_for(self, weight_dtype: str) -> float:
        """Dense FLOP/s for matmuls with ``weight_dtype`` weights: FP8 at the FP8 rate when the
        device has one, float32 at half the BF16 rate, the rest at BF16.
        """
        if weight_dtype.startswith("float8") and self.dense_fp8_flops > 0:
            return self.dense_fp8_flops
        if weight_dtype == "float32":
            return self.dense_bf16_flops / 2
        return self.dense_bf16_flops

    def source_summary(self) -> str:
        """One line naming the entry and the source of each figure (``hardware_source``)."""
        parts = "; ".join(f"{k}: {v}" for k, v in self.sources.items())
        return f"{self.name} ({self.description}) — {parts}"


_H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column)"
_H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column)"
_B200_SHEET = "NVIDIA DGX B200 / HGX B200 datasheets (8-GPU totals divided by 8)"

CATALOGUE: dict[str, Hardware] = {
    "cpu": Hardware(
        name="cpu",
        description="a generic small server CPU target: a 2-vCPU VM, as kiln's CI machine",
        memory_bytes=16 * GB,
        memory_bandwidth_bytes_per_s=20 * GB,
        dense_bf16_flops=100e9,
        dense_fp8_flops=0.0,
        interconnect_bandwidth_bytes_per_s=0.0,
        interconnect="none",
        max_devices_per_node=1,
        achievable_bandwidth_fraction=1.0,
        collective_latency_s=0.0,
        sources={
            "memory_bytes": "assumption: 16 GB of RAM usable by one engine on a small VM",
            "memory_bandwidth_bytes_per_s": (
                "assumption: ~20 GB/s sustained (STREAM-like) for 2 vCPUs on DDR4/DDR5 servers; "
                "already an achievable figure, so the fraction is 1.0"
            ),
            "dense_bf16_flops": (
                "assumption: ~100 GFLOP/s BF16 for 2 cores (AVX-512 at ~3 GHz peaks near "
                "190 GFLOP/s; half of it is what matmul libraries sustain)"
            ),
            "dense_fp8_flops": "none: CPUs have no FP8 matmul units",
            "interconnect": "single device, no interconnect",
            "note": "all cpu numbers are assumptions until the microbenchmark tier measures them",
        },
    ),
    "h100": Hardware(
        name="h100",
        description="NVIDIA H100 SXM5 80 GB in an 8-GPU HGX node",
        memory_bytes=80 * GB,
        memory_bandwidth_bytes_per_s=3.35 * TB,
        dense_bf16_flops=989 * TFLOPS,
        dense_fp8_flops=1979 * TFLOPS,
        interconnect_bandwidth_bytes_per_s=450 * GB,
        interconnect="NVLink 4",
        max_devices_per_node=8,
        achievable_bandwidth_fraction=0.89,
        **_GPU_NODE,
        sources={
            "memory_bytes": f"{_H100_SHEET}: 80 GB HBM3",
            "memory_bandwidth_bytes_per_s": f"{_H100_SHEET}: 3.35 TB/s",
            "dense_bf16_flops": f"{_H100_SHEET}: 1,979 TFLOPS BF16 with sparsity, 989 dense",
            "dense_fp8_flops": f"{_H100_SHEET}: 3,958 TFLOPS FP8 with sparsity, 1,979 dense",
            "interconnect_bandwidth_bytes_per_s": _NVLINK4,
            "max_devices_per_node": "HGX H100: 8 GPUs per NVSwitch node",
            "achievable_bandwidth_fraction": (
                "assumption: the H200's measured 4.26/4.8 (same Hopper memory system)"
            ),
            **_gpu_node_sources(_NDR),
        },
    ),
    "h200": Hardware(
        name="h200",
        description="NVIDIA H200 SXM 141 GB in an 8-GPU HGX node",
        memory_bytes=141 * GB,
        memory_bandwidth_bytes_per_s=4.8 * TB,
        dense_bf16_flops=989 * TFLOPS,
        dense_fp8_flops=1979 * TFLOPS,
        interconnect_bandwidth_bytes_per_s=450 * GB,
        interconnect="NVLink 4",
        max_devices_per_node=8,
        achievable_bandwidth_fraction=4.26 / 4.8,
        **_GPU_NODE,
        sources={
            "memory_bytes": f"{_H200_SHEET}: 141 GB HBM3e",
            "memory_bandwidth_bytes_per_s": f"{_H200_SHEET}: 4.8 TB/s",
            "dense_bf16_flops": f"{_H200_SHEET}: 1,979 TFLOPS BF16 with sparsity, 989 dense",
            "dense_fp8_flops": f"{_H200_SHEET}: 3,958 TFLOPS FP8 with sparsity, 1,979 dense",
            "interconnect_bandwidth_bytes_per_s": _NVLINK4,
            "max_devices_per_node": "HGX H200: 8 GPUs per NVSwitch node",
            "achievable_bandwidth_fraction": (
                "measured: ~4.26 TB/s device-to-device copy on kiln's lent H200 (kiln issue 3), "
                "4.26 / 4.8 = 0.8875"
            ),
            **_gpu_node_sources(_NDR),
        },
    ),
    "b200": Hardware(
        name="b200",
        description="NVIDIA B200 in an 8-GPU HGX/DGX B200 node",
        memory_bytes=180 * GB,
        memory_bandwidth_bytes_per_s=8 * TB,
        dense_bf16_flops=2250 * TFLOPS,
        dense_fp8_flops=4500 * TFLOPS,
        interconnect_bandwidth_bytes_per_s=900 * GB,
        interconnect="NVLink 5",
        max_devices_per_node=8,
        achievable_bandwidth_fraction=0.89,
        **_GPU_NODE,
        sources={
            "memory_bytes": f"{_B200_SHEET}: 1,440 GB HBM3e per 8 GPUs = 180 GB each",
            "memory_bandwidth_bytes_per_s": f"{_B200_SHEET}: 64 TB/s per 8 GPUs = 8 TB/s each",
            "dense_bf16_flops": (
                f"{_B200_SHEET}: 36 PFLOPS FP16/BF16 with sparsity per 8 GPUs = 2.25 PFLOPS dense"
            ),
            "dense_fp8_flops": (
                f"{_B200_SHEET}: 72 PFLOPS FP8 with sparsity per 8 GPUs = 4.5 PFLOPS dense"
            ),
            "interconnect_bandwidth_bytes_per_s": (
                "NVLink 5: 1.8 TB/s total bidirectional per GPU (14.4 TB/s per 8), i.e. 900 GB/s "
                "per direction (HGX B200 datasheet)"
            ),
            "max_devices_per_node": "HGX/DGX B200: 8 GPUs per NVSwitch node",
            "achievable_bandwidth_fraction": (
                "assumption: the H200's measured 4.26/4.8 ≈ 0.89 until a B200 is measured"
            ),
            **_gpu_node_sources(_NDR_B200),
        },
    ),
}


def get_hardware(name: str) -> Hardware:
    """The entry called ``name`` (case-insensitive); NotFound listing the known names."""
    hw = CATALOGUE.get(name.strip().lower())
    if hw is None:
        raise NotFound(
            f"unknown hardware {quote(name)}: the catalogue has {', '.join(sorted(CATALOGUE))}"
        )
    return hw
