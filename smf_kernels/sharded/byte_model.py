"""The byte model of docs/sharding.md: what each rank sends per layer and step when a memory's value table is
split over W ranks, by columns (what :mod:`smf_kernels.sharded` does) or by rows (the alternative), and what
that costs in time on an interconnect. Pure arithmetic; ``benchmarks/bench_sharded.py`` checks it against
measured bytes and prints the tables of the document.

Notation: W ranks, rank r holds ``N_r`` tokens (N in all), a token reads ``L = heads * topk`` slots, value
rows are D wide with ``s`` bytes per element, slot ids travel as int32 and read weights as fp32 (4 bytes).
"Sent" means bytes a rank hands to collectives for other ranks (its own chunk never leaves it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from smf_kernels.sharded.exchange import AGREEMENT_WIDTH
from smf_kernels.sharded.layout import column_bounds

ID_BYTES = WEIGHT_BYTES = 4
COUNT_BYTES = 8  # read counts are int64


@dataclass(frozen=True)
class Layer:
    """The sizes that decide the traffic: ``slots`` M, value width ``dim`` D, ``reads`` L = heads * topk per
    token, ``value_bytes`` s per value element (4 fp32, 2 bf16)."""

    slots: int
    dim: int
    reads: int
    value_bytes: int = 4


PAPER = Layer(slots=128 ** 2, dim=896, reads=4 * 16)
ONE_MILLION = Layer(slots=1024 ** 2, dim=896, reads=4 * 16)


def column_read_bytes(layer: Layer, tokens: list[int], rank: int, *, weight_grads: bool = True) -> dict[str, int]:
    """Bytes rank ``rank`` sends in one forward + backward of a column-sharded read, by collective, with
    ``tokens[s]`` tokens on rank s (exactly what :mod:`smf_kernels.sharded.exchange` hands to all_to_all).
    ``weight_grads``: whether the lookup trains (retrofit), so that read weights get gradients; in SMF's
    stage 2 only the values train and that exchange does not happen."""
    world = len(tokens)
    if world == 1:
        return {}
    bounds = column_bounds(layer.dim, world)
    mine, total, width = tokens[rank], sum(tokens), bounds[rank + 1] - bounds[rank]
    result = {
        "token_counts": (world - 1) * AGREEMENT_WIDTH * COUNT_BYTES,  # with the fields ranks must agree on
        "reads": (world - 1) * mine * layer.reads * (ID_BYTES + WEIGHT_BYTES),  # every token's ids and weights
        "read_columns": (total - mine) * width * layer.value_bytes,  # my columns of the others' tokens
        "read_column_grads": mine * (layer.dim - width) * layer.value_bytes,  # their columns of my tokens' grads
    }
    if weight_grads:
        result["read_weight_grads"] = (total - mine) * layer.reads * WEIGHT_BYTES  # partial grads of their tokens
    return result


def column_bytes_per_token(layer: Layer, world: int, *, weight_grads: bool = True) -> float:
    """Column sharding, balanced tokens: bytes a rank sends per token it holds, per layer, forward + backward:
    ``(W-1) L (4 + 4 [+ 4 with weight_grads]) + 2 (W-1)/W D s``."""
    per_read = ID_BYTES + WEIGHT_BYTES + (WEIGHT_BYTES if weight_grads else 0)
    return (world - 1) * layer.reads * per_read + 2 * (world - 1) / world * layer.dim * layer.value_bytes


def row_bytes_per_token(layer: Layer, world: int) -> float:
    """Row sharding (each rank holds M/W rows, not implemented): a token sends each read to the rank owning its
    row and gets back one partial row sum per rank it touched; the backward sends those ranks the output
    gradient and gets the weight gradients back. Expected ranks touched besides its own, for L uniform reads:
    ``(W-1) (1 - (1 - 1/W)^L)``. Bytes per token: ``(W-1)/W L (4 + 4 + 4) + 2 touched D s``."""
    touched = (world - 1) * (1 - (1 - 1 / world) ** layer.reads)
    per_read = ID_BYTES + 2 * WEIGHT_BYTES
    return (world - 1) / world * layer.reads * per_read + 2 * touched * layer.dim * layer.value_bytes


def ring_all_reduce_bytes(num_bytes: int, world: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal (ring) all_reduce of ``num_bytes``: ``2 (W-1)/W`` of it."""
    return 2 * (world - 1) / world * num_bytes


def smf_step_bytes(layers: list[Layer], world: int, *, clip: bool = True) -> dict[str, float]:
    """Bytes a rank sends per optimizer step for SMF besides the reads: the read counts summed over ranks (one
    all_reduce of every layer's (M,) int64 counts, as the controller does) and, with ``clip``, one fp32 squared
    norm per sharded table. Nothing for the value gradients: each shard's is complete where it is."""
    if world == 1:
        return {}
    result = {"read_counts": ring_all_reduce_bytes(sum(layer.slots for layer in layers) * COUNT_BYTES, world)}
    if clip:
        result["clip_norms"] = len(layers) * ring_all_reduce_bytes(4, world)
    return result


@dataclass(frozen=True)
class Interconnect:
    """Bandwidth per GPU and direction (bytes/s) within a node and between nodes, GPUs per node, and the
    latency of one collective (seconds; all_to_all pays it once per peer)."""

    name: str
    node_bandwidth: float
    network_bandwidth: float
    gpus_per_node: int
    latency: float
    per_peer_latency: float


# H100 SXM nodes: NVLink 4 (450 GB/s per direction per GPU, ~80% reached by NCCL all_to_all) and one
# 400 Gb/s InfiniBand NDR port per GPU (50 GB/s, ~80% reached). Assumptions of docs/sharding.md.
H100_NODES = Interconnect("8x H100 NVLink nodes, NDR InfiniBand", 360e9, 40e9, 8, 20e-6, 1e-6)


def exchange_seconds(bytes_per_token: float, tokens: int, world: int, net: Interconnect) -> float:
    """Time a rank spends sending ``bytes_per_token * tokens`` spread evenly over its W-1 peers: the peers in
    its node over NVLink, the others over the network, both at once (the slower decides)."""
    if world == 1:
        return 0.0
    total = bytes_per_token * tokens
    node_peers = min(world, net.gpus_per_node) - 1
    remote_peers = world - 1 - node_peers
    local = total * node_peers / (world - 1) / net.node_bandwidth
    remote = total * remote_peers / (world - 1) / net.network_bandwidth
    return max(local, remote)


def all_reduce_seconds(num_bytes: float, world: int, net: Interconnect) -> float:
    """A ring all_reduce of ``num_bytes``: bounded by the network once the ring leaves the node."""
    if world == 1:
        return 0.0
    bandwidth = net.node_bandwidth if world <= net.gpus_per_node else net.network_bandwidth
    return ring_all_reduce_bytes(num_bytes, world) / bandwidth + net.latency


def column_step_seconds(layer: Layer, tokens_per_rank: int, world: int, net: Interconnect, *, forwards: int = 1,
                        weight_grads: bool = False) -> dict[str, float]:
    """Predicted communication time per layer and optimizer step for column sharding: the read's exchanges
    (``forwards`` forwards, e.g. 2 with the counting forward of gradient accumulation; ``weight_grads`` as in
    :func:`column_read_bytes`) and the read-count all_reduce; each forward's 3 collectives and the backward's
    1 or 2 pay the latency."""
    if world == 1:
        return {"reads": 0.0, "counts": 0.0, "latency": 0.0}
    forward_bytes = (world - 1) * (layer.reads * (ID_BYTES + WEIGHT_BYTES) + layer.dim * layer.value_bytes / world)
    backward_bytes = column_bytes_per_token(layer, world, weight_grads=weight_grads) - forward_bytes
    reads = (forwards * exchange_seconds(forward_bytes, tokens_per_rank, world, net)
             + exchange_seconds(backward_bytes, tokens_per_rank, world, net))
    latency = (3 * forwards + 1 + weight_grads) * (net.latency + (world - 1) * net.per_peer_latency)
    return {"reads": reads, "counts": all_reduce_seconds(layer.slots * COUNT_BYTES, world, net), "latency": latency}


def crossover_world(layer: Layer, seconds_per_token: float, net: Interconnect, tokens_per_rank: int,
                    max_world: int = 1024, **step) -> int | None:
    """The smallest power-of-two world size at which column sharding's communication per step
    (:func:`column_step_seconds` with ``step``'s options) exceeds the layer's compute (``seconds_per_token *
    tokens_per_rank``), or None up to ``max_world``."""
    world = 2
    while world <= max_world:
        if world > layer.dim:
            return world  # fewer than one column per rank: column sharding cannot go further
        seconds = sum(column_step_seconds(layer, tokens_per_rank, world, net, **step).values())
        if seconds > seconds_per_token * tokens_per_rank:
            return world
        world *= 2
    return None


def log2_worlds(first: int = 8, last: int = 1024) -> list[int]:
    return [2 ** power for power in range(int(math.log2(first)), int(math.log2(last)) + 1)]
