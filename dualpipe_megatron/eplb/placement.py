"""Placements: which logical expert each physical expert slot holds.

A placement of one MoE layer is ``phy2log`` (``[slots]``): slot ``p`` lives on EP rank
``p // k`` (``k`` = slots per rank) and holds logical expert ``phy2log[p]``. Without redundant
experts it is a permutation of the experts, and Megatron's own placement is the identity; with
them (:mod:`.redundancy`) an expert may hold several slots. Every change moves expert weights
between ranks, so :func:`align` renumbers a planned placement to keep as many experts where
they already are as the plan allows.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


def identity(num_layers: int, num_experts: int) -> torch.Tensor:
    """Megatron's placement: slot ``p`` holds expert ``p``, every layer."""
    return torch.arange(num_experts).repeat(num_layers, 1)


def replica_counts(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Slots of each logical expert, ``[layers, num_experts]``."""
    counts = torch.zeros(phy2log.size(0), num_experts, dtype=torch.int64)
    return counts.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def as_plan(phy2log: torch.Tensor, num_experts: int | None = None) -> tuple[torch.Tensor, None, torch.Tensor]:
    """``(phy2log, log2phy, logcnt)`` as :mod:`.guard` reads it (it needs no ``log2phy``);
    ``num_experts`` defaults to the slots (a permutation)."""
    return phy2log, None, replica_counts(phy2log, num_experts or phy2log.size(-1))


def check_permutation(phy2log: torch.Tensor, num_experts: int) -> None:
    """Refuse anything but one slot per logical expert (redundant experts are another feature)."""
    expected = torch.arange(num_experts)
    for layer, row in enumerate(phy2log):
        if not torch.equal(row.sort().values, expected):
            raise ValueError(f"layer {layer}: placement {row.tolist()} is not a permutation of "
                             f"{num_experts} experts")


def _match(held: list[set[int]], wanted: list[set[int]]) -> list[int]:
    """For each wanted set, a distinct held one: greedy by overlap (largest first, then lowest indices)."""
    pairs = sorted(((len(h & w), -j, -i) for j, w in enumerate(wanted) for i, h in enumerate(held)), reverse=True)
    chosen: dict[int, int] = {}
    taken: set[int] = set()
    for _, neg_j, neg_i in pairs:
        j, i = -neg_j, -neg_i
        if j not in chosen and i not in taken:
            chosen[j] = i
            taken.add(i)
    return [chosen[j] for j in range(len(wanted))]


def align(current: torch.Tensor, proposed: torch.Tensor, ep_size: int,
          nodes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``proposed`` renumbered to move the fewest experts; the same experts share a rank.

    The planner's packs are unordered and so are the slots within one: each pack goes to the
    rank already holding most of its experts (greedy by overlap), and each expert staying on
    its rank keeps its slot (with redundant experts, as many of its copies as stay). With
    ``nodes`` (the EP ranks of each node, equal sizes) a pack only moves within its node, and a
    node's packs together go to the node already holding most of their experts: node-limited
    plans stay node-limited.
    """
    num_slots = current.numel()
    per_rank = num_slots // ep_size
    nodes = [list(range(ep_size))] if nodes is None else [list(n) for n in nodes]
    now = [set(current[r * per_rank:(r + 1) * per_rank].tolist()) for r in range(ep_size)]
    packs = [proposed[g * per_rank:(g + 1) * per_rank].tolist() for g in range(ep_size)]
    node_sets = [set().union(*(now[r] for r in node)) for node in nodes]
    planned_sets = [set().union(*(set(packs[g]) for g in node)) for node in nodes]
    rank_of: dict[int, int] = {}
    for b, a in enumerate(_match(node_sets, planned_sets)):
        targets = _match([now[r] for r in nodes[a]], [set(packs[g]) for g in nodes[b]])
        rank_of.update({g: nodes[a][t] for g, t in zip(nodes[b], targets)})
    out = torch.empty_like(current)
    for g, pack in enumerate(packs):
        r = rank_of[g]
        slots = current[r * per_rank:(r + 1) * per_rank].tolist()
        wanted = Counter(pack)  # the pack's experts not yet given a slot
        kept: list[int | None] = []
        for e in slots:
            stays = wanted[e] > 0
            kept.append(e if stays else None)
            wanted[e] -= stays
        arriving = iter([e for e in pack for _ in range(_take(wanted, e))])
        out[r * per_rank:(r + 1) * per_rank] = torch.tensor(
            [e if e is not None else next(arriving) for e in kept])
    return out


def _take(wanted: Counter, e: int) -> int:
    """1 (and one fewer wanted) if ``e`` is still wanted, else 0: hands out copies in pack order."""
    if wanted[e] <= 0:
        return 0
    wanted[e] -= 1
    return 1


def sources(current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """For each slot of ``new``, the slot of ``current`` that holds its expert now."""
    return torch.argsort(current)[new]


__all__ = ["align", "as_plan", "check_permutation", "identity", "replica_counts", "sources"]
