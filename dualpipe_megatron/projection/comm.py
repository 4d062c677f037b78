"""Communication time of one micro-batch: pipeline p2p and the MoE all-to-all.

Bandwidths are achieved GB/s per GPU (1 GB = 1e9 bytes), all parameters. The
all-to-all follows DeepSeek-V3's routing: a token goes to ``topk`` experts on
at most ``nodes_per_token`` nodes; it crosses the inter-node network once per
remote node and is then forwarded over NVLink to the GPUs holding its experts.
The two links run at the same time, so one transfer takes the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..schedules.model_shape import ModelShape
from .shapes import ProjectionError


@dataclass(frozen=True)
class Network:
    """Link speeds and placement of the job (defaults: assumed, not measured)."""

    ib_gbps: float = 50.0  # inter-node, per GPU: one 400 Gb/s NIC per GPU
    nvlink_gbps: float = 160.0  # intra-node, per GPU, achieved by all-to-all kernels
    p2p_gbps: float = 50.0  # pipeline neighbours sit on different nodes: inter-node
    p2p_latency_ms: float = 0.01
    gpus_per_node: int = 8
    nodes_per_token: int = 4  # DeepSeek-V3's node-limited routing
    dtype_bytes: int = 2  # activations and all-to-all payloads (bf16)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (value == 0 and f.name != "p2p_latency_ms"):
                raise ProjectionError(f"{f.name} must be positive, got {value}")


def p2p_ms(shape: ModelShape, net: Network) -> float:
    """Sending one micro-batch's hidden states (or their grads) to the next stage."""
    size = shape.tokens * shape.hidden * net.dtype_bytes
    return size / (net.p2p_gbps * 1e6) + net.p2p_latency_ms


def a2a_transfer_ms(shape: ModelShape, net: Network) -> float:
    """One dispatch (or one combine) of one micro-batch through one MoE layer.

    With the EP group spread over ``n`` nodes, a token picks ``k`` of them and
    its own node is among those with probability ``k/n``, so it crosses the
    inter-node network ``k(1 - 1/n)`` times; of its ``topk`` copies, those for
    another GPU than the one they land on cross NVLink: ``topk(1 - 1/g)`` for
    ``g`` EP GPUs per node. Uniform routing and balanced load are assumed.
    """
    per_node = min(net.gpus_per_node, shape.ep)
    nodes = -(-shape.ep // per_node)
    picked = min(net.nodes_per_token, nodes, shape.topk)
    token = shape.hidden * net.dtype_bytes
    inter = shape.tokens * token * picked * (1 - 1 / nodes)
    intra = shape.tokens * token * shape.topk * (1 - 1 / per_node)
    return max(inter / (net.ib_gbps * 1e6), intra / (net.nvlink_gbps * 1e6))


def a2a_ms(shape: ModelShape, net: Network) -> float:
    """All-to-all of one pass (forward or backward) of one micro-batch through the chunk (``shape``'s ``num_layers`` MoE layers).

    A pass moves each layer's tokens twice: dispatch and combine going forward,
    the grads of combine and of dispatch going backward. The weight-grad pass
    moves nothing.
    """
    return 2 * shape.num_layers * a2a_transfer_ms(shape, net)


__all__ = ["Network", "a2a_ms", "a2a_transfer_ms", "p2p_ms"]
