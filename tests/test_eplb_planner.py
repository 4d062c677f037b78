"""The EPLB planner equals DeepSeek's reference and keeps its placement invariants;
the guard never adopts a placement predicted to be worse than the current one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualpipe_megatron.eplb import adopt, gpu_loads, imbalance, rebalance_experts

pytestmark = pytest.mark.unit

VECTORS = json.loads((Path(__file__).parent / "data" / "eplb_vectors.json").read_text())

# (layers, logical experts, replicas, groups, nodes, gpus); groups % nodes != 0 -> global policy.
CONFIGS = [(3, 16, 24, 4, 2, 8), (2, 12, 18, 3, 3, 6), (2, 12, 16, 3, 2, 8), (2, 32, 48, 8, 4, 16),
           (2, 10, 20, 5, 2, 4), (2, 24, 32, 6, 4, 8), (1, 8, 8, 2, 1, 4), (2, 16, 20, 4, 2, 4)]


def test_readme_vector() -> None:
    # Input and printed output of the example in https://github.com/deepseek-ai/EPLB README.md
    # (commit d52c72d5b2f2fb4c41afbf8eb21366820239913d), hierarchical policy.
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    _check_consistent(phy2log, log2phy, logcnt)


@pytest.mark.parametrize("case", VECTORS["vectors"], ids=lambda c: f"{c['policy']}-{c['dtype']}")
def test_reference_vectors(case: dict) -> None:
    weight = torch.tensor(case["weight"], dtype=getattr(torch, case["dtype"]))
    got = rebalance_experts(weight, case["num_replicas"], case["num_groups"], case["num_nodes"], case["num_gpus"])
    assert [t.tolist() for t in got] == [case["phy2log"], case["log2phy"], case["logcnt"]]


def test_vectors_cover_both_policies_and_ties() -> None:
    assert {c["policy"] for c in VECTORS["vectors"]} == {"hierarchical", "global"}
    # Rows longer than 16 with equal loads: where torch's unstable sort order matters.
    assert any(len(c["weight"][0]) > 16 and len(set(c["weight"][0])) < len(c["weight"][0])
               for c in VECTORS["vectors"])


def _check_consistent(phy2log: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> None:
    """log2phy lists, for each expert, exactly the slots phy2log gives it, then -1 padding."""
    layers, num_log = logcnt.shape
    assert log2phy.shape == (layers, num_log, int(logcnt.max()))
    for layer in range(layers):
        for expert in range(num_log):
            slots = (phy2log[layer] == expert).nonzero().flatten().tolist()
            row = log2phy[layer, expert].tolist()
            count = int(logcnt[layer, expert])
            assert len(slots) == count
            assert sorted(row[:count]) == slots and row[count:] == [-1] * (len(row) - count)


@pytest.mark.parametrize("config", CONFIGS)
def test_properties_on_integer_loads(config: tuple[int, ...]) -> None:
    layers, num_log, replicas, groups, nodes, gpus = config
    gen = torch.Generator().manual_seed(sum(config))
    for _ in range(20):
        weight = torch.randint(0, 50, (layers, num_log), generator=gen)
        phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
        assert phy2log.shape == (layers, replicas) and logcnt.shape == (layers, num_log)
        assert bool((logcnt >= 1).all()) and logcnt.sum(dim=1).tolist() == [replicas] * layers
        assert bool(((phy2log >= 0) & (phy2log < num_log)).all())
        # Each GPU holds replicas / gpus slots, every one with an expert; their loads sum to the total.
        per_gpu = gpu_loads((phy2log, log2phy, logcnt), weight, gpus)
        assert per_gpu.shape == (layers, gpus)
        assert per_gpu.sum(dim=1).tolist() == pytest.approx(weight.double().sum(dim=1).tolist())
        _check_consistent(phy2log, log2phy, logcnt)
        if groups % nodes == 0:  # hierarchical: a node holds whole groups, groups / nodes of them
            group_of = phy2log.view(layers, nodes, -1) // (num_log // groups)
            for layer in range(layers):
                node_groups = [set(group_of[layer, node].tolist()) for node in range(nodes)]
                assert all(len(g) == groups // nodes for g in node_groups)
                assert set().union(*node_groups) == set(range(groups))


def test_global_policy_when_nodes_do_not_divide_groups() -> None:
    """3 groups on 2 nodes: one node cannot hold whole groups, so the plan is the global one."""
    weight = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(rebalance_experts(weight, 16, 3, 2, 8),
                                                 rebalance_experts(weight, 16, 1, 1, 8)))


@pytest.mark.parametrize(("shape", "args", "message"), [
    ((12,), (16, 4, 2, 8), "must be \\[layers"),
    ((2, 12), (8, 4, 2, 4), "num_replicas \\(8\\) must be >="),
    ((2, 12), (16, 5, 1, 8), "num_groups \\(5\\) must divide"),
    ((2, 12), (16, 4, 3, 8), "num_nodes \\(3\\) must divide num_gpus"),
    ((2, 12), (18, 4, 2, 8), "num_gpus \\(8\\) must divide num_replicas"),
    ((2, 12), (16, 4, 0, 8), "num_nodes must be a positive int"),
])
def test_bad_inputs_raise(shape: tuple[int, ...], args: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rebalance_experts(torch.ones(shape), *args)


def test_negative_load_raises() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(-torch.ones(2, 12), 16, 4, 2, 8)


def test_guard_never_adopts_a_worse_placement() -> None:
    gen = torch.Generator().manual_seed(0)
    kept_worse_plan = 0
    for _ in range(400):
        load, stale = torch.randint(0, 100, (2, 1, 16), generator=gen)
        current = rebalance_experts(stale, 20, 4, 2, 4)  # planned for an older load
        proposed = rebalance_experts(load, 20, 4, 2, 4)
        before, planned = imbalance(current, load, 4), imbalance(proposed, load, 4)
        for threshold in (0.0, 0.01, 0.05):
            chosen = adopt(current, proposed, load, threshold, num_gpus=4)
            assert chosen is proposed if before - planned >= threshold and planned < before else chosen is current
            assert imbalance(chosen, load, 4) <= before
        kept_worse_plan += planned > before
    assert kept_worse_plan > 0  # the planner alone would have made some of these worse


def test_guard_rejects_negative_threshold() -> None:
    plan = rebalance_experts(torch.ones(1, 8), 8, 2, 1, 4)
    with pytest.raises(ValueError, match="threshold"):
        adopt(plan, plan, torch.ones(1, 8), -0.1, num_gpus=4)
