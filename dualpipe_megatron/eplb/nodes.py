"""Node-limited placement: which node each EP rank is on, and the policy that follows.

Megatron's group-limited routing (``--moe-router-num-groups G --moe-router-group-topk T``) sends a
token to experts of at most ``T`` of ``G`` contiguous expert groups. That limits the nodes a token
reaches only if each group's experts (all their copies) sit on one node: DeepSeek's hierarchical
policy plans exactly that, ``rebalance_experts(load, slots, G, N, EP)`` over the EP group's ``N``
nodes. The planner numbers GPUs node by node; the EP ranks of a node need not be contiguous
(TP/CP ranks may interleave), so :class:`NodeLayout` maps the planner's GPUs to EP ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .planner import hierarchical_problem


@dataclass(frozen=True)
class NodeLayout:
    """The EP ranks of each node, nodes in the order of their first EP rank."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def ep_size(self) -> int:
        return sum(map(len, self.nodes))

    @property
    def gpu_order(self) -> list[int]:
        """EP rank of each planner GPU (GPU ``i`` of node ``n`` is the ``i``-th EP rank of node ``n``)."""
        return [r for node in self.nodes for r in node]

    @property
    def node_of(self) -> list[int]:
        """Node index of each EP rank."""
        of = [0] * self.ep_size
        for n, node in enumerate(self.nodes):
            for r in node:
                of[r] = n
        return of

    def in_ep_order(self, phy2log: torch.Tensor) -> torch.Tensor:
        """A planner row (slots GPU by GPU) as a placement row (slots EP rank by EP rank)."""
        per_rank = phy2log.numel() // self.ep_size
        out = torch.empty_like(phy2log)
        for gpu, rank in enumerate(self.gpu_order):
            out[rank * per_rank:(rank + 1) * per_rank] = phy2log[gpu * per_rank:(gpu + 1) * per_rank]
        return out

    def keeps_groups(self, phy2log: torch.Tensor, num_groups: int, num_experts: int) -> bool:
        """Whether every slot of each expert group of this placement row lies on one node."""
        per_rank, group_size, node_of = phy2log.numel() // self.ep_size, num_experts // num_groups, self.node_of
        nodes_of_group: dict[int, set[int]] = {}
        for slot, expert in enumerate(phy2log.tolist()):
            nodes_of_group.setdefault(expert // group_size, set()).add(node_of[slot // per_rank])
        return all(len(n) == 1 for n in nodes_of_group.values())


def node_pattern(global_ranks: Sequence[int], gpus_per_node: int) -> tuple[int, ...]:
    """Node index of each EP rank (global rank ``// gpus_per_node``), numbered by first appearance:
    the same tuple on every EP group whose nodes are laid out alike."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(g // gpus_per_node, len(first)) for g in global_ranks)


@dataclass(frozen=True)
class Policy:
    """How re-placement plans: ``groups`` expert groups over ``layout``'s nodes; ``reason`` says why."""

    groups: int
    layout: NodeLayout
    reason: str

    @property
    def hierarchical(self) -> bool:
        return self.groups > 1

    @property
    def num_nodes(self) -> int:
        return len(self.layout.nodes)


def _one_node(ep_size: int) -> NodeLayout:
    return NodeLayout((tuple(range(ep_size)),))


def choose_policy(num_experts: int, num_slots: int, num_groups: int, patterns: Sequence[tuple[int, ...]]) -> Policy:
    """The hierarchical policy for ``num_groups`` groups over the nodes of ``patterns`` (one
    :func:`node_pattern` per EP group, all ranks'), else the global one with the reason."""
    ep_size = len(patterns[0])
    if num_groups <= 1:
        return Policy(1, _one_node(ep_size), "global policy (one routing group)")

    def fallback(why: str) -> Policy:
        return Policy(1, _one_node(ep_size), f"global policy, not node-limited: {why}")

    if any(p != patterns[0] for p in patterns):
        return fallback("EP groups lie on nodes differently (" + ", ".join(sorted({str(list(p)) for p in patterns}))
                        + "), but data-parallel copies of a layer need one placement")
    pattern = patterns[0]
    layout = NodeLayout(tuple(tuple(r for r in range(ep_size) if pattern[r] == n) for n in range(max(pattern) + 1)))
    sizes = sorted({len(node) for node in layout.nodes})
    if len(sizes) > 1:
        return fallback(f"nodes hold different numbers of EP ranks ({', '.join(map(str, sizes))})")
    problem = hierarchical_problem(num_experts, num_slots, num_groups, len(layout.nodes), ep_size)
    if problem:
        return fallback(problem)
    return Policy(num_groups, layout, f"hierarchical policy: {num_groups} expert groups over "
                                      f"{len(layout.nodes)} node(s) of {sizes[0]} EP rank(s), each group on one node")


__all__ = ["NodeLayout", "Policy", "choose_policy", "node_pattern"]
