"""EPLB's pieces below the training loop: placements, the load window, the router hook, the
flags' checks, and the checkpoint option the schedule flag turns off (one process, no Megatron job)."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from dualpipe_megatron.eplb import imbalance, rebalance_experts
from dualpipe_megatron.eplb.experts import MoELayerHandle, install_router_hook, take_counts
from dualpipe_megatron.eplb.placement import align, as_plan, check_permutation, identity, sources
from dualpipe_megatron.eplb.stats import LoadStats, read_stats_file

pytestmark = pytest.mark.unit


def _per_rank_sets(phy2log: torch.Tensor, ep_size: int) -> list[set[int]]:
    k = phy2log.numel() // ep_size
    return [set(phy2log[r * k:(r + 1) * k].tolist()) for r in range(ep_size)]


@pytest.mark.parametrize("seed", range(20))
def test_align_keeps_the_plan_and_moves_fewest(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    experts, ep = 16, 4
    current = torch.randperm(experts, generator=g)
    load = torch.rand(1, experts, generator=g, dtype=torch.float64) * 100
    plan = rebalance_experts(load, experts, 1, 1, ep)[0][0]
    aligned = align(current, plan, ep)
    check_permutation(aligned[None], experts)
    # The same groups of experts share a rank (only which rank and slot changed) ...
    assert sorted(map(sorted, _per_rank_sets(aligned, ep))) == sorted(map(sorted, _per_rank_sets(plan, ep)))
    assert imbalance(as_plan(aligned[None]), load, ep) == pytest.approx(imbalance(as_plan(plan[None]), load, ep))
    # ... and an expert that stays on its rank keeps its slot.
    k = experts // ep
    after = _per_rank_sets(aligned, ep)
    for slot in range(experts):
        if int(current[slot]) in after[slot // k]:
            assert aligned[slot] == current[slot], (current, aligned)
    assert int((aligned != current).sum()) <= int((plan != current).sum())


def test_align_of_the_same_groups_moves_nothing() -> None:
    current = torch.tensor([3, 0, 1, 2, 7, 4, 5, 6])
    shuffled = torch.tensor([4, 6, 7, 5, 2, 1, 3, 0])  # rank 0's and rank 1's sets swapped and reordered
    assert torch.equal(align(current, shuffled, 2), current)


def test_sources_name_the_slot_holding_each_expert() -> None:
    current = torch.tensor([2, 0, 3, 1])
    new = torch.tensor([0, 1, 2, 3])
    src = sources(current, new)
    assert torch.equal(current[src], new)


def test_check_permutation_refuses_duplicates() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        check_permutation(torch.tensor([[0, 0, 1, 2]]), 4)
    check_permutation(identity(3, 4), 4)


def test_load_window_averages_the_last_iterations_and_round_trips(tmp_path) -> None:
    stats = LoadStats([1, 2], 4, window=2)
    for i in range(3):
        stats.add(torch.full((2, 4), float(i)))
    assert stats.average().tolist() == [[1.5] * 4] * 2  # iterations 1 and 2 only
    with pytest.raises(ValueError, match="counts shape"):
        stats.add(torch.zeros(3, 4))
    path = tmp_path / "s.json"
    placement = torch.tensor([[1, 0, 2, 3], [0, 1, 2, 3]])
    stats.save(path, 7, placement, ep_size=2)
    back, whole = read_stats_file(path)
    assert torch.equal(back.average(), stats.average()) and whole["placement"] == placement.tolist()
    assert whole["iteration"] == 7 and whole["load"] == stats.average().tolist()


class _Router(nn.Module):
    """Megatron's router contract: (probs, routing_map), both [tokens, experts], logical."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(x, dim=-1)
        top = probs.topk(2, dim=-1).indices
        routing_map = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top, True)
        return probs * routing_map, routing_map


def test_router_hook_counts_logically_and_hands_out_physical_columns() -> None:
    router = _Router()
    layer = MoELayerHandle(key=("decoder", 1), router=router, experts=nn.Module(), num_experts=4,
                           ep_group=None, slot_params=[])
    install_router_hook(layer)
    x = torch.randn(6, 4)
    plain_probs, plain_map = _Router.forward(router, x)
    layer.phy2log = torch.tensor([2, 0, 3, 1])
    probs, routing_map = router(x)
    assert torch.equal(probs, plain_probs[:, layer.phy2log]) and torch.equal(routing_map, plain_map[:, layer.phy2log])
    assert torch.equal(take_counts(layer), plain_map.sum(0))  # logical order, not physical
    router.eval()
    router(x)
    assert torch.equal(take_counts(layer), torch.zeros(4, dtype=torch.int64))  # evaluation is not counted


def _args(**overrides) -> argparse.Namespace:
    base = dict(eplb_interval=2, eplb_window=4, eplb_threshold=0.0, eplb_stats_file=None, num_experts=8,
                expert_model_parallel_size=2, async_save=False, use_distributed_optimizer=False,
                overlap_param_gather=False, moe_token_dispatcher_type="alltoall", eplb_redundant_experts=0,
                eplb_gpus_per_node=None, pipeline_schedule="dualpipev")
    return argparse.Namespace(**{**base, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"eplb_interval": -1}, "--eplb-interval must be >= 0"),
    ({"eplb_window": 0}, "--eplb-window must be >= 1"),
    ({"eplb_threshold": -0.1}, "--eplb-threshold must be >= 0"),
    ({"eplb_gpus_per_node": 0}, "--eplb-gpus-per-node must be >= 1"),
    ({"num_experts": None}, "need an MoE model"),
    ({"expert_model_parallel_size": 1}, "--expert-model-parallel-size > 1"),
    ({"async_save": True}, "--async-save"),
    ({"use_distributed_optimizer": True, "overlap_param_gather": True}, "--overlap-param-gather"),
    ({"moe_token_dispatcher_type": "flex"}, "alltoall and allgather"),
    ({"eplb_redundant_experts": -2}, "--eplb-redundant-experts must be >= 0"),
    ({"eplb_redundant_experts": 3}, "must be a multiple of --expert-model-parallel-size (2)"),
    ({"eplb_redundant_experts": 2, "expert_model_parallel_size": 1}, "needs --expert-model-parallel-size > 1"),
    ({"eplb_redundant_experts": 2, "moe_grouped_gemm": True}, "leave out --moe-grouped-gemm"),
    ({"eplb_redundant_experts": 2, "moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
    ({"eplb_redundant_experts": 2, "moe_apply_probs_on_input": True}, "--moe-apply-probs-on-input"),
    ({"eplb_redundant_experts": 2, "fp8": "hybrid"}, "FP8/FP4 experts"),
    ({"eplb_redundant_experts": 2, "moe_token_dispatcher_type": "flex"}, "alltoall and allgather token"),
])
def test_flags_refuse_what_eplb_cannot_run(overrides: dict, message: str) -> None:
    from dualpipe_megatron.eplb.training import argument_problems

    problems = argument_problems(_args(**overrides))
    assert any(message in p for p in problems), problems


def test_flags_accept_a_plain_setup_and_stats_only() -> None:
    from dualpipe_megatron.eplb.training import argument_problems

    assert argument_problems(_args()) == []
    assert argument_problems(_args(eplb_interval=0, expert_model_parallel_size=1, eplb_stats_file="s.json")) == []
    assert argument_problems(_args(eplb_redundant_experts=4)) == []
    assert argument_problems(_args(eplb_interval=0, eplb_redundant_experts=2)) == []  # static copies


@pytest.mark.parametrize("untie, mtp, dp, expected", [
    (False, None, 2, False), (True, None, 2, True), (True, 1, 2, False), (False, None, 1, True),
])
def test_fully_parallel_save_is_off_when_embedding_copies_share_a_rank(untie, mtp, dp, expected) -> None:
    from dualpipe_megatron.megatron.training_hooks import _save_embedding_copies_plainly

    args = argparse.Namespace(untie_embeddings_and_output_weights=untie, mtp_num_layers=mtp,
                              data_parallel_size=dp, ckpt_fully_parallel_save=True, rank=1)
    _save_embedding_copies_plainly(args)
    assert args.ckpt_fully_parallel_save is expected
