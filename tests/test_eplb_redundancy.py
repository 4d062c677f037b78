"""Redundant experts without Megatron: compute slots, owners, routing to copies, transfers."""

from __future__ import annotations

import pytest
import torch

from dualpipe_megatron.eplb.guard import imbalance
from dualpipe_megatron.eplb.placement import align, as_plan
from dualpipe_megatron.eplb.planner import rebalance_experts
from dualpipe_megatron.eplb.redundancy import (choose_owners, copy_table, initial_slots, replica_transfers,
                                               route_to_copies)

pytestmark = pytest.mark.unit


def test_initial_slots_own_then_replicate_the_neighbour() -> None:
    assert initial_slots(8, 2, 2).tolist() == [0, 1, 2, 3, 4, 4, 5, 6, 7, 0]
    assert initial_slots(4, 4, 4).tolist() == [0, 1, 1, 2, 2, 3, 3, 0]
    # Even load: every rank gets the same share (each replicated expert split over two slots).
    slots = initial_slots(8, 4, 2)
    assert imbalance(as_plan(slots[None], 8), torch.ones(1, 8), 2) == pytest.approx(1.0)


def _most_local_owners(computes: list[set[int]], experts: int, per_rank: int) -> int:
    import networkx as nx

    graph = nx.DiGraph()
    for e in range(experts):
        graph.add_edge("s", ("e", e), capacity=1)
    for r, computed in enumerate(computes):
        graph.add_edge(("r", r), "t", capacity=per_rank)
        for e in computed:
            graph.add_edge(("e", e), ("r", r), capacity=1)
    return nx.maximum_flow_value(graph, "s", "t")


def _check_owners(owners: torch.Tensor, num_experts: int) -> None:
    assert sorted(owners.tolist()) == list(range(num_experts))


@pytest.mark.parametrize("seed", range(20))
def test_owners_follow_the_planned_slots(seed: int) -> None:
    experts, ep, extra = 16, 4, 8
    load = torch.rand(1, experts, generator=torch.Generator().manual_seed(seed)) ** 3 * 100
    slots = rebalance_experts(load, experts + extra, 1, 1, ep)[0][0]
    current = torch.randperm(experts, generator=torch.Generator().manual_seed(100 + seed))
    owners = choose_owners(slots, current, ep)
    _check_owners(owners, experts)
    per, per_slot = experts // ep, (experts + extra) // ep
    computes = [set(slots[r * per_slot:(r + 1) * per_slot].tolist()) for r in range(ep)]
    # As many owners sit where their expert is computed as any assignment allows (max flow).
    local = sum(owners[p].item() in computes[p // per] for p in range(experts))
    assert local == _most_local_owners(computes, experts, per)
    # Deterministic, and a second call from its own result keeps every owner (no moves).
    assert torch.equal(choose_owners(slots, current, ep), owners)
    assert torch.equal(choose_owners(slots, owners, ep), owners)


def test_owners_stay_in_their_slot() -> None:
    current = torch.tensor([3, 0, 1, 2, 4, 5, 6, 7])
    slots = torch.tensor([0, 1, 3, 3, 7, 4, 5, 6, 2, 2])  # rank 0 computes 7 but not 2, rank 1 2 but not 7
    owners = choose_owners(slots, current, 2)
    assert owners.tolist() == [3, 0, 1, 7, 4, 5, 6, 2]  # 2 and 7 swap owners, each into the other's slot


def test_align_keeps_copies_in_place() -> None:
    current = torch.tensor([0, 1, 2, 3, 4, 4, 5, 6, 7, 0])
    proposed = torch.tensor([4, 5, 6, 7, 7, 0, 0, 1, 2, 3])  # the packs of the ranks swapped, 0 twice
    got = align(current, proposed, 2)
    assert got.tolist() == [0, 1, 2, 3, 0, 4, 5, 6, 7, 7]


def test_route_to_copies_round_robin() -> None:
    table = copy_table(torch.tensor([0, 1, 2, 0]), 3)  # expert 0 in slots 0 and 3
    assert table.copies.tolist() == [2, 1, 1]
    routing = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 0]], dtype=torch.bool)
    probs = torch.rand(5, 3) * routing
    probs.requires_grad_(True)
    out_probs, out_map = route_to_copies(probs, routing, table, offset=0)
    # Expert 0's tokens 0, 1, 2, 4 alternate: slot 0, slot 3, slot 0, slot 3.
    assert out_map[:, 0].tolist() == [True, False, True, False, False]
    assert out_map[:, 3].tolist() == [False, True, False, False, True]
    assert torch.equal(out_map[:, 1:3], routing[:, 1:3])
    assert torch.equal(out_probs.sum(dim=1), probs.sum(dim=1))
    # Each routed pair lands in exactly one copy; gradients flow back to the router's probs.
    assert int(out_map.sum()) == int(routing.sum())
    out_probs.sum().backward()
    assert torch.equal(probs.grad, routing.float())  # the routed entries, once each
    # The rank offset starts the round robin at another copy.
    _, shifted = route_to_copies(probs.detach(), routing, table, offset=1)
    assert shifted[:, 3].tolist() == [True, False, True, False, False]


def test_route_even_split() -> None:
    table = copy_table(torch.tensor([0, 1, 0, 0]), 2)  # three copies of expert 0
    routing = torch.zeros(100, 2, dtype=torch.bool)
    routing[:, 0] = True
    _, out_map = route_to_copies(torch.rand(100, 2), routing, table, offset=2)
    per_slot = out_map.sum(dim=0).tolist()
    assert per_slot[1] == 0 and sorted(per_slot[i] for i in (0, 2, 3)) == [33, 33, 34]


def test_copy_table_refuses_a_missing_expert() -> None:
    with pytest.raises(ValueError, match=r"experts \[2\] without a slot"):
        copy_table(torch.tensor([0, 1, 1, 0]), 3)


def test_replica_transfers() -> None:
    slots = torch.tensor([0, 1, 2, 3, 4, 4, 5, 6, 7, 0])
    owners = torch.arange(8)
    assert replica_transfers(slots, owners, 2) == [(0, 0, 1), (4, 1, 0)]
    # Two slots of one expert on one rank share one replica; a local copy needs none.
    slots = torch.tensor([0, 1, 2, 3, 5, 4, 5, 6, 7, 5])
    assert replica_transfers(slots, owners, 2) == [(5, 1, 0)]
