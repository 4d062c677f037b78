"""Node-limited EPLB without Megatron: each EP rank's node, the policy and its fallbacks, and
``align`` keeping every pack of a hierarchical plan on its node (one process, fast)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from dualpipe_megatron.eplb import rebalance_experts
from dualpipe_megatron.eplb.nodes import NodeLayout, choose_policy, node_pattern
from dualpipe_megatron.eplb.placement import align
from dualpipe_megatron.eplb.redundancy import initial_slots

pytestmark = pytest.mark.unit

NodeForm = list[tuple[tuple[int, ...], ...]]


def node_form(row: Sequence[int], nodes: Sequence[Sequence[int]]) -> NodeForm:
    """A placement row (slots EP rank by EP rank) with the order of nodes, of ranks within a node
    and of slots within a rank forgotten: what renumbering within nodes cannot change."""
    per_rank = len(row) // sum(map(len, nodes))
    packs = [tuple(sorted(row[r * per_rank:(r + 1) * per_rank])) for r in range(len(row) // per_rank)]
    return sorted(tuple(sorted(packs[r] for r in node)) for node in nodes)


def planner_form(phy2log: Sequence[int], num_nodes: int, num_gpus: int) -> NodeForm:
    """:func:`node_form` of a planner row: its node ``n`` holds GPUs ``n * gpus/nodes ..``."""
    per_node = num_gpus // num_nodes
    return node_form(list(phy2log), [range(n * per_node, (n + 1) * per_node) for n in range(num_nodes)])


@pytest.mark.parametrize("ranks, per_node, expected", [
    ([0, 1, 2, 3], 2, (0, 0, 1, 1)),  # EP over contiguous ranks
    ([0, 2, 4, 6], 4, (0, 0, 1, 1)),  # TP=2 interleaves the EP ranks
    ([5, 7, 9, 11], 4, (0, 0, 1, 1)),  # another TP rank's EP group: the same pattern
    ([0, 1, 2, 3], 8, (0, 0, 0, 0)),  # one node
    ([0, 4, 1, 5], 4, (0, 1, 0, 1)),  # nodes alternate along the EP ranks
    ([0, 1], 1, (0, 1)),  # one GPU per node
])
def test_node_pattern(ranks: list[int], per_node: int, expected: tuple[int, ...]) -> None:
    assert node_pattern(ranks, per_node) == expected


def test_hierarchical_policy_maps_planner_gpus_to_ep_ranks_node_by_node() -> None:
    policy = choose_policy(8, 8, 2, [(0, 1, 0, 1)] * 3)
    assert policy.hierarchical and policy.groups == 2 and policy.num_nodes == 2
    assert policy.layout.nodes == ((0, 2), (1, 3)) and policy.layout.gpu_order == [0, 2, 1, 3]
    assert policy.reason == ("hierarchical policy: 2 expert groups over 2 node(s) of 2 EP rank(s), "
                             "each group on one node")
    # Planner GPU 1 (node 0's second) is EP rank 2.
    assert policy.layout.in_ep_order(torch.arange(8)).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert choose_policy(8, 8, 4, [(0, 0, 0, 0)]).num_nodes == 1  # groups, one node: DeepSeek's (G, 1) call


@pytest.mark.parametrize("experts, slots, groups, patterns, why", [
    (8, 8, 3, [(0, 0, 1, 1)], "num_groups (3) must divide the number of logical experts (8)"),
    (12, 12, 3, [(0, 0, 1, 1)], "2 nodes do not divide 3 expert groups"),
    (8, 8, 2, [(0, 0, 0, 1)], "nodes hold different numbers of EP ranks (1, 3)"),
    (8, 8, 2, [(0, 0, 1, 1), (0, 0, 0, 0)], "EP groups lie on nodes differently"),
    (8, 8, 4, [(0, 1, 2, 3, 4, 5, 6, 7)], "8 nodes do not divide 4 expert groups"),
])
def test_policy_falls_back_to_global_and_says_why(experts: int, slots: int, groups: int,
                                                  patterns: list[tuple[int, ...]], why: str) -> None:
    policy = choose_policy(experts, slots, groups, patterns)
    assert not policy.hierarchical and policy.num_nodes == 1 and policy.groups == 1
    assert policy.reason.startswith("global policy, not node-limited: ") and why in policy.reason, policy.reason


def test_one_group_is_the_global_policy() -> None:
    policy = choose_policy(8, 10, 1, [(0, 0, 1, 1)])
    assert not policy.hierarchical and policy.reason == "global policy (one routing group)"


def test_keeps_groups() -> None:
    contiguous, alternating = NodeLayout(((0, 1), (2, 3))), NodeLayout(((0, 2), (1, 3)))
    identity = torch.arange(8)
    assert contiguous.keeps_groups(identity, 2, 8) and not alternating.keeps_groups(identity, 2, 8)
    assert not contiguous.keeps_groups(torch.tensor([0, 1, 2, 4, 3, 5, 6, 7]), 2, 8)
    # A copy of expert 0 (group 0) on node 1 breaks it; on node 0 it does not.
    assert not contiguous.keeps_groups(torch.tensor([0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 0, 5]), 2, 8)
    assert contiguous.keeps_groups(torch.tensor([0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 4, 5]), 2, 8)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("nodes", [((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0,), (1,)), ((0, 1, 2), (3, 4, 5))])
def test_align_keeps_each_pack_of_a_hierarchical_plan_on_its_node(seed: int, nodes: tuple) -> None:
    g = torch.Generator().manual_seed(seed)
    layout = NodeLayout(nodes)
    ep, num_nodes = layout.ep_size, len(nodes)
    experts, groups = 4 * ep, 2 * num_nodes
    slots = experts + ep * int(torch.randint(0, 3, (1,), generator=g))  # 0 to 2 redundant slots per rank
    load = (torch.rand(1, experts, generator=g, dtype=torch.float64) * 100) ** 2
    plan = rebalance_experts(load, slots, groups, num_nodes, ep)[0][0]
    every_expert_and_extras = torch.cat([torch.randperm(experts, generator=g),
                                         torch.randint(0, experts, (slots - experts,), generator=g)])
    current = every_expert_and_extras[torch.randperm(slots, generator=g)]
    proposed = layout.in_ep_order(plan)
    assert node_form(proposed.tolist(), nodes) == planner_form(plan.tolist(), num_nodes, ep)
    aligned = align(current, proposed, ep, layout.nodes)
    # Each node's packs are exactly one planned node's packs (no pack left its planned node's
    # company; nodes' expert sets differ), so groups stay whole on a node.
    assert node_form(aligned.tolist(), nodes) == planner_form(plan.tolist(), num_nodes, ep)
    assert layout.keeps_groups(aligned, groups, experts) and layout.keeps_groups(proposed, groups, experts)
    # Every copy of an expert that stays on its rank keeps its slot.
    per_rank = slots // ep
    for r in range(ep):
        before, after = current[r * per_rank:(r + 1) * per_rank], aligned[r * per_rank:(r + 1) * per_rank]
        for e in set(before.tolist()):
            kept = int(((before == e) & (after == e)).sum())
            assert kept == min(int((before == e).sum()), int((after == e).sum())), (current, aligned)


def test_align_moves_a_planned_node_whole() -> None:
    nodes = ((0, 1), (2, 3))
    current = torch.arange(8)  # node 0 (ranks 0, 1) holds experts 0-3
    swapped = torch.tensor([5, 4, 7, 6, 1, 0, 3, 2])  # the planner put experts 0-3 on its node 1
    assert torch.equal(align(current, swapped, 4, nodes), current)  # renumbered back: nothing moves
    # Rank 0's planned pack {4, 5} sits on rank 2 now, but its node-mate {2, 3} on node 0: packs
    # of one planned node stay together, so {4, 5} moves to node 0 instead of {2, 3} leaving it.
    mixed = torch.tensor([4, 5, 2, 3, 0, 1, 6, 7])
    assert align(current, mixed, 4, nodes).tolist() == mixed.tolist()
    assert align(current, mixed, 4).tolist() == current.tolist()  # one node: each pack to its holder


@pytest.mark.parametrize("nodes, expected", [
    (None, [0, 1, 2, 2, 3, 4, 4, 5, 6, 6, 7, 0]),  # the next rank's first expert
    (((0, 1), (2, 3)), [0, 1, 2, 2, 3, 0, 4, 5, 6, 6, 7, 4]),  # the next rank of the node's
    (((0,), (1,), (2,), (3,)), [0, 1, 0, 2, 3, 2, 4, 5, 4, 6, 7, 6]),  # alone on a node: its own
])
def test_initial_copies_stay_on_their_owners_node(nodes, expected) -> None:
    assert initial_slots(8, 4, 4, nodes).tolist() == expected
