"""Placements without redundancy: which logical expert each physical expert slot holds.

A placement of one MoE layer is ``phy2log`` (``[num_experts]``, a permutation): slot ``p``
lives on EP rank ``p // k`` (``k`` = experts per rank) and holds logical expert
``phy2log[p]``. Megatron's own placement is the identity. Every change moves expert weights
and optimizer state between ranks, so :func:`align` renumbers a planned placement to keep
as many experts where they already are as the plan allows.
"""

from __future__ import annotations

import torch


def identity(num_layers: int, num_experts: int) -> torch.Tensor:
    """Megatron's placement: slot ``p`` holds expert ``p``, every layer."""
    return torch.arange(num_experts).repeat(num_layers, 1)


def as_plan(phy2log: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(phy2log, log2phy, logcnt)`` of permutations, the form :mod:`.guard` takes."""
    log2phy = torch.argsort(phy2log, dim=-1).unsqueeze(-1)
    return phy2log, log2phy, torch.ones_like(phy2log)


def check_permutation(phy2log: torch.Tensor, num_experts: int) -> None:
    """Refuse anything but one slot per logical expert (redundant experts are another feature)."""
    expected = torch.arange(num_experts)
    for layer, row in enumerate(phy2log):
        if not torch.equal(row.sort().values, expected):
            raise ValueError(f"layer {layer}: placement {row.tolist()} is not a permutation of "
                             f"{num_experts} experts")


def align(current: torch.Tensor, proposed: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``proposed`` renumbered to move the fewest experts; the same experts share a rank.

    The planner's packs are unordered and so are the slots within one: each pack goes to the
    rank already holding most of its experts (greedy by overlap), and each expert staying on
    its rank keeps its slot.
    """
    num_experts = current.numel()
    per_rank = num_experts // ep_size
    now = [set(current[r * per_rank:(r + 1) * per_rank].tolist()) for r in range(ep_size)]
    packs = [proposed[g * per_rank:(g + 1) * per_rank].tolist() for g in range(ep_size)]
    pairs = sorted(((len(now[r] & set(pack)), -g, -r) for g, pack in enumerate(packs) for r in range(ep_size)),
                   reverse=True)
    rank_of: dict[int, int] = {}
    taken: set[int] = set()
    for _, neg_g, neg_r in pairs:
        g, r = -neg_g, -neg_r
        if g not in rank_of and r not in taken:
            rank_of[g] = r
            taken.add(r)
    out = torch.empty_like(current)
    for g, pack in enumerate(packs):
        r = rank_of[g]
        slots = current[r * per_rank:(r + 1) * per_rank].tolist()
        staying = set(pack) & set(slots)
        arriving = iter(e for e in pack if e not in staying)
        out[r * per_rank:(r + 1) * per_rank] = torch.tensor(
            [e if e in staying else next(arriving) for e in slots])
    return out


def sources(current: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """For each slot of ``new``, the slot of ``current`` that holds its expert now."""
    return torch.argsort(current)[new]


__all__ = ["align", "as_plan", "check_permutation", "identity", "sources"]
