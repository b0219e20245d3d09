"""Seconds of the collectives a plan's step pays: ring all-reduce, all-to-all inside and across
nodes, and the pipeline's sends between stages (latencies and links from the catalogue)."""

from __future__ import annotations

from kiln.cost_model.hardware import Hardware
from kiln.cost_model.sharding import Parallelism


def collective_s(
    hw: Hardware, nbytes: float, ranks: int, ring: bool = True, *, across_nodes: bool = False
) -> float:
    """Seconds for one collective of ``nbytes`` per device over ``ranks`` (ring all-reduce, or
    ``nbytes / link + latency`` with ``ring=False``); 0 for one rank, inf without an
    interconnect. ``across_nodes``: over the inter-node link at its latency (the in-node link
    where the catalogue has none).
    """
    if ranks <= 1:
        return 0.0
    link, latency = hw.interconnect_bandwidth_bytes_per_s, hw.collective_latency_s
    if across_nodes and hw.inter_node_bandwidth_bytes_per_s > 0:
        link, latency = hw.inter_node_bandwidth_bytes_per_s, hw.inter_node_latency_s
    if link <= 0:
        return float("inf")
    factor = 2 * (ranks - 1) / ranks if ring else 1.0
    return nbytes * factor / link + latency + (ranks - 1) * hw.collective_latency_per_peer_s


def all_to_all_s(hw: Hardware, nbytes: float, ranks: int) -> float:
    """Seconds for one all-to-all over ``ranks`` in which each rank sends ``nbytes`` spread
    evenly over the ranks (its own share stays). Inside a node: ``nbytes (n-1)/n / link +
    latency + (n-1) x per-peer latency``. Over ``n > node`` ranks the in-node share ``(node-1)/n``
    goes over the in-node link while the off-node share ``(n-node)/n`` goes over the inter-node
    link, ``max`` of the two, plus the inter-node latency and the per-peer latencies; inf
    without an inter-node link.
    """
    if ranks <= 1:
        return 0.0
    node = hw.max_devices_per_node
    if ranks <= node:
        return collective_s(hw, nbytes * (ranks - 1) / ranks, ranks, ring=False)
    inter, intra = hw.inter_node_bandwidth_bytes_per_s, hw.interconnect_bandwidth_bytes_per_s
    if inter <= 0 or intra <= 0:
        return float("inf")
    wire = max(nbytes * (node - 1) / ranks / intra, nbytes * (ranks - node) / ranks / inter)
    return wire + hw.inter_node_latency_s + (ranks - 1) * hw.collective_latency_per_peer_s


def pp_inter_node_sends(plan: Parallelism, node: int) -> int:
    """Of the ``pp - 1`` sends between stages, those crossing nodes, ranks laid out TP first,
    then DP, then PP (Megatron's order; a stage's tp x dp ranks together): all of them when a
    stage fills a node, else ``tp x dp x pp / node - 1``."""
    if plan.pp <= 1:
        return 0
    stage = plan.tp * plan.dp
    if stage >= node:
        return plan.pp - 1
    return max(0, min(plan.pp - 1, -(-stage * plan.pp // node) - 1))
