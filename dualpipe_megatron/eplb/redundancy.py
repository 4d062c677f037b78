"""Redundant experts: ``E`` logical experts computed in ``S = E + K`` physical slots.

Two placements per MoE layer:

- **compute slots** ``slots`` (``[S]``, EP rank ``r`` computes slots ``r*S/EP ..``): which logical
  expert each slot runs; a hot expert holds several. The planner decides them.
- **owners** ``owners`` (``[E]``, a permutation, ``E/EP`` per rank): which rank keeps each expert's
  *parameter* (Megatron's expert module, its optimizer state and its checkpoint entry). A slot
  whose expert is owned on its own rank runs the parameter itself; any other slot runs a replica,
  a copy kept outside the model (:mod:`.replicas`). :func:`choose_owners` keeps owners where they
  are and puts them where their expert is computed, so replicas are few and moves rare.

Routing (:func:`route_to_copies`): each token routed to expert ``e`` goes to exactly one of its
``c_e`` copies. On each rank, for each micro-batch, the ``j``-th token of ``e`` (in token order)
goes to copy ``(j + ep_rank) mod c_e``: deterministic, and each copy gets its share to within one
token; the rank offset spreads the remainders over the copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def initial_slots(num_experts: int, redundant: int, ep_size: int,
                  nodes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Before any load is known: rank ``r`` computes the experts it owns (Megatron's placement)
    and replicates the first experts of the next rank of its node (cyclically; ``nodes``: the EP
    ranks of each node, default one node), so copies stay on their owner's node. Under even load
    every rank gets the same share."""
    per_rank, extra = num_experts // ep_size, redundant // ep_size
    following = {}
    for node in nodes or [range(ep_size)]:
        node = list(node)
        following.update({r: node[(i + 1) % len(node)] for i, r in enumerate(node)})
    row: list[int] = []
    for r in range(ep_size):
        neighbour = following[r] * per_rank
        row += list(range(r * per_rank, (r + 1) * per_rank)) + [neighbour + j % per_rank for j in range(extra)]
    return torch.tensor(row, dtype=torch.int64)


def choose_owners(slots: torch.Tensor, current: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Owners (``[E]``, parameter slot -> expert) for compute ``slots``, starting from ``current``.

    Each rank owns ``E/EP`` experts. As many experts as possible are owned by a rank computing
    them (a maximum matching: every such expert saves one replica), keeping current owners where
    that costs nothing: first every expert its current rank computes stays, then each other
    expert (fewest computing ranks first) takes a computing rank with room, or one freed by
    moving an already placed expert to another of its computing ranks (augmenting path). The
    rest fill the remaining room in expert order; owners staying on a rank keep their slot.
    """
    num_experts = current.numel()
    per_rank, per_rank_slots = num_experts // ep_size, slots.numel() // ep_size
    computes = [set(slots[r * per_rank_slots:(r + 1) * per_rank_slots].tolist()) for r in range(ep_size)]
    now = {int(e): p // per_rank for p, e in enumerate(current.tolist())}
    rank_of: dict[int, int] = {e: now[e] for e in range(num_experts) if e in computes[now[e]]}
    room = [per_rank - sum(r == q for r in rank_of.values()) for q in range(ep_size)]

    def place(e: int, seen: set[int]) -> bool:
        ranks = sorted((r for r in range(ep_size) if e in computes[r] and r not in seen), key=lambda r: (-room[r], r))
        seen.update(ranks)
        for r in ranks:
            if room[r] > 0:
                rank_of[e], room[r] = r, room[r] - 1
                return True
        for r in ranks:
            for other in sorted(x for x, q in rank_of.items() if q == r):
                if place_elsewhere(other, seen):
                    rank_of[e] = r
                    return True
        return False

    def place_elsewhere(e: int, seen: set[int]) -> bool:
        home = rank_of.pop(e)
        room[home] += 1
        if place(e, seen):
            room[home] -= 1  # the freed unit goes to whoever asked for it
            return True
        rank_of[e] = home
        room[home] -= 1
        return False

    for e in sorted((e for e in range(num_experts) if e not in rank_of),
                    key=lambda e: (sum(e in c for c in computes), e)):
        place(e, set())
    for e in range(num_experts):
        if e not in rank_of:
            rank_of[e] = next(r for r in range(ep_size) if room[r] > 0)
            room[rank_of[e]] -= 1
    owners = torch.empty_like(current)
    for r in range(ep_size):
        mine = [e for e in range(num_experts) if rank_of[e] == r]
        here = current[r * per_rank:(r + 1) * per_rank].tolist()
        arriving = iter([e for e in mine if e not in here])
        owners[r * per_rank:(r + 1) * per_rank] = torch.tensor([e if e in mine else next(arriving) for e in here])
    return owners


@dataclass(frozen=True)
class CopyTable:
    """Where each logical expert's copies are: ``slot_of[e, i]`` is copy ``i``'s slot
    (rows padded with their first copy), ``copies[e]`` how many there are."""

    slot_of: torch.Tensor  # [E, max copies]
    copies: torch.Tensor  # [E]
    num_slots: int


def copy_table(slots: torch.Tensor, num_experts: int) -> CopyTable:
    per_expert: list[list[int]] = [[] for _ in range(num_experts)]
    for slot, e in enumerate(slots.tolist()):
        per_expert[e].append(slot)
    if any(not s for s in per_expert):
        missing = [e for e, s in enumerate(per_expert) if not s]
        raise ValueError(f"compute slots {slots.tolist()} leave experts {missing} without a slot")
    width = max(map(len, per_expert))
    slot_of = torch.tensor([s + [s[0]] * (width - len(s)) for s in per_expert], dtype=torch.int64)
    return CopyTable(slot_of, torch.tensor([len(s) for s in per_expert], dtype=torch.int64), slots.numel())


def route_to_copies(probs: torch.Tensor, routing_map: torch.Tensor, table: CopyTable,
                    offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logical ``[tokens, E]`` output as ``[tokens, S]`` over compute slots: each
    routed (token, expert) to one copy, round robin in token order from copy ``offset``."""
    tokens, e_idx = routing_map.nonzero(as_tuple=True)
    order = routing_map.to(torch.int64).cumsum(dim=0) - 1  # j: the token's rank among e's tokens
    copies = table.copies.to(probs.device)
    copy = (order[tokens, e_idx] + offset) % copies[e_idx]
    slot = table.slot_of.to(probs.device)[e_idx, copy]
    out_probs = probs.new_zeros(probs.size(0), table.num_slots).index_put((tokens, slot), probs[tokens, e_idx])
    out_map = routing_map.new_zeros(routing_map.size(0), table.num_slots).index_put(
        (tokens, slot), torch.ones_like(slot, dtype=routing_map.dtype))
    return out_probs, out_map


def replica_transfers(slots: torch.Tensor, owners: torch.Tensor, ep_size: int) -> list[tuple[int, int, int]]:
    """``(expert, owner rank, replica rank)`` for every replica, sorted: who sends which weights
    after each step and receives which gradients before it ends. A rank computing an expert in
    several slots keeps one replica."""
    per_rank, per_rank_slots = owners.numel() // ep_size, slots.numel() // ep_size
    owner_of = {int(e): p // per_rank for p, e in enumerate(owners.tolist())}
    needed = {(int(e), s // per_rank_slots) for s, e in enumerate(slots.tolist())}
    return sorted((e, owner_of[e], r) for e, r in needed if owner_of[e] != r)


__all__ = ["CopyTable", "choose_owners", "copy_table", "initial_slots", "replica_transfers", "route_to_copies"]
