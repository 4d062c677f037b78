"""EPLB re-placement and redundant experts in Megatron training through ``scripts/pretrain_gpt.py``
(4 CPU processes, gloo).

MoE GPT: 8 layers, 8 experts, top-2, alltoall dispatcher, aux loss on, RoPE, tied output layer
(its copy shares rank 0 with the embedding under DualPipeV: the save at data parallel 2 also
checks that the flag turns Megatron's fully parallel save off); 8 iterations, M=8 micro-batches. With ``--eplb-interval 2 --eplb-threshold 0`` experts are re-placed after
iterations 2, 4 and 6 (not after the last one): their weights and Adam state move between EP
ranks and the router's output is remapped, so every iteration's ``lm loss`` must equal the same
run without EPLB (relative 1e-5; the combine sums each token's expert outputs in another order)
and grad norms to 1e-4. Runs:

- two redundant experts everywhere (``--eplb-redundant-experts 2``: 10 compute slots for 8
  experts, replicas from the first iteration, re-planned with the moves): EP=2 x P=2 under
  Megatron's 1F1B with the distributed optimizer and the allgather dispatcher, and under
  DualPipeV with the plain optimizer and the alltoall dispatcher; EP=2 x DP=4 (P=1, Megatron's
  no-pipelining schedule: two expert data-parallel ranks) with the distributed optimizer and
  ``--overlap-grad-reduce``, where DDP would start reducing an owner's gradient before its
  replicas' arrive unless EPLB holds the expert buckets (without that, iteration 2's grad norm
  and iteration 3's loss differ). ``DUALPIPE_EPLB_CHECK_REPLICAS=1`` compares every replica with
  its owner bitwise before every iteration (the run fails on a difference; the test counts the
  checks), and the log says how many routed tokens the replicas computed;
- node-limited placement: EP=4 (P=1) over two simulated nodes of two ranks
  (``--eplb-gpus-per-node 2``) with group-limited routing (2 groups, a token in one) and 4
  redundant experts; ``DUALPIPE_EPLB_LOG_PLANS=1`` logs each re-plan's load and placements, and
  each must be DeepSeek's ``rebalance_experts(load, 12, 2, 2, 4)`` of that load up to renumbering
  within nodes, with every group's experts (copies included) on one node;
- the DualPipeV run saves a checkpoint at iteration 4, right after a move; it resumes *without*
  EPLB (no redundancy) under DualPipeV and *with* EPLB and redundancy (placement and statistics
  restored) under DualPipe, where each model copy's replicas reach that copy's owners before the
  mirrored copies' gradients are summed; both continue the uninterrupted run's losses. The run without EPLB saves too, and resumes with
  redundant experts: checkpoints go both ways between K = 0 and K > 0. The checkpoint holds experts in Megatron's order plus ``eplb.json`` (statistics
  and the placement). (Resuming the distributed optimizer's checkpoint fails in Megatron 0.19.2
  without Transformer Engine or apex, EPLB or not: ``DistributedOptimizer.state_dict`` asserts
  one Adam ``step`` over an empty state, so the 1F1B run does not save.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher import LaunchFailed
from pretrain_runs import TRAIN, grad_norms, logged, losses, run

from test_eplb_nodes import node_form, planner_form

from dualpipe_megatron.eplb import rebalance_experts
from dualpipe_megatron.eplb.nodes import NodeLayout
from dualpipe_megatron.eplb.redundancy import initial_slots
from dualpipe_megatron.eplb.stats import read_stats_file

pytestmark = pytest.mark.multiprocess

MOE = ("--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2 "
       "--disable-bias-linear --position-embedding-type rope").split()
EP2_P2 = ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
EP2_DP4 = ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]
EPLB = ["--eplb-interval", "2", "--eplb-window", "4", "--eplb-threshold", "0"]
REDUNDANT = [*EPLB, "--eplb-redundant-experts", "2"]
ITERS, RESUME_FROM = 8, 4
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4
MOVED = re.compile(r"^EPLB iteration (\d+): moved (\d+) expert(?:s| slots) .* predicted ([0-9.]+)(?:, measured ([0-9.]+))?",
                   re.MULTILINE)
# No "$": another rank's output (a warning) can continue the line without a newline.
CHECKED = re.compile(r"^EPLB replica check: all (\d+) replicas equal their owners bitwise \(iteration (\d+)\)",
                     re.MULTILINE)
REPLICA_TOKENS = re.compile(r"^EPLB replica sync: [0-9.]+ ms per step .*replicas computed (\d+) routed tokens",
                            re.MULTILINE)
PLAN = "EPLB plan at iteration "
RESUMED = re.compile(r"^EPLB: resumed with (\d+) iterations of the checkpoint's expert load and (.*)$", re.MULTILINE)

ONE_F_ONE_B = [*EP2_P2, "--pipeline-schedule", "1f1b", "--use-distributed-optimizer",
               "--moe-token-dispatcher-type", "allgather"]
DUALPIPEV = [*EP2_P2, "--pipeline-schedule", "dualpipev"]
# Node-limited: EP=4 over two simulated nodes of 2 ranks, 2 routing groups, a token in one of them.
GROUPS, NODES, NODE_SIZE, HIERARCHICAL_SLOTS = 2, 2, 2, 12
EP4_GROUPS = ["--expert-model-parallel-size", "4", "--moe-router-num-groups", str(GROUPS),
              "--moe-router-group-topk", "1"]
HIERARCHICAL = [*EPLB, "--eplb-redundant-experts", str(HIERARCHICAL_SLOTS - 8),
                "--eplb-gpus-per-node", str(NODE_SIZE)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DUALPIPE_EPLB_CHECK_REPLICAS", "1")
        env.setenv("DUALPIPE_EPLB_LOG_PLANS", "1")
        return _run_jobs(tmp_path_factory.mktemp("eplb_training"))


def _run_jobs(out: Path) -> dict[str, Any]:
    common = [*MOE, *TRAIN, "--train-iters", str(ITERS)]

    def stats(name: str) -> list[str]:
        return ["--eplb-stats-file", str(out / f"{name}_stats.json")]

    def save(name: str) -> list[str]:
        return ["--save", str(out / name), "--save-interval", str(RESUME_FROM)]

    def resume(name: str) -> list[str]:
        return ["--load", str(out / name), "--ckpt-step", str(RESUME_FROM)]  # saved at 4 and 8

    runs = {
        "1f1b": ONE_F_ONE_B,
        "1f1b_eplb": [*ONE_F_ONE_B, *REDUNDANT, *stats("1f1b_eplb")],
        "dualpipev": [*DUALPIPEV, *save("ckpt_plain")],
        "dualpipev_eplb": [*DUALPIPEV, *REDUNDANT, *stats("dualpipev_eplb"), *save("ckpt")],
        "dualpipev_eplb_resumed_without_eplb": [*DUALPIPEV, *resume("ckpt")],
        "dualpipe_resumed_with_eplb": [*EP2_P2, "--pipeline-schedule", "dualpipe", *REDUNDANT, *resume("ckpt")],
        "dualpipev_resumed_with_redundancy": [*DUALPIPEV, *REDUNDANT, *resume("ckpt_plain")],
        "ep2dp4": EP2_DP4,
        "ep2dp4_eplb": [*EP2_DP4, *REDUNDANT],
        "ep4_groups": EP4_GROUPS,
        "ep4_groups_hierarchical": [*EP4_GROUPS, *HIERARCHICAL],
    }
    got: dict[str, Any] = {"out": out}
    try:
        for name, args in runs.items():
            log = run(name, out, 4, [*common, *args])
            got[name] = {"log": log, "loss": losses(log), "grad_norm": grad_norms(log),
                         "metric": logged(log, "eplb_max_mean_load"),
                         "moves": [(int(i), int(n), float(p), m) for i, n, p, m in MOVED.findall(log)],
                         "resumed": RESUMED.findall(log),
                         "checked": [(int(n), int(i)) for n, i in CHECKED.findall(log)],
                         "replica_tokens": [int(t) for t in REPLICA_TOKENS.findall(log)],
                         "plans": _plans(log)}
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _plans(log: str) -> dict[int, dict[str, Any]]:
    """The ``DUALPIPE_EPLB_LOG_PLANS`` lines by iteration (raw_decode: another rank may continue a line)."""
    plans = {}
    for line in log.splitlines():
        if line.startswith(PLAN):
            iteration, _, rest = line[len(PLAN):].partition(": ")
            plans[int(iteration)] = json.JSONDecoder().raw_decode(rest)[0]
    return plans


def _equal(got: dict[int, float], want: dict[int, float], rtol: float, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: iterations {sorted(got)} vs {sorted(want)}"
    for it in want:
        assert got[it] == pytest.approx(want[it], rel=rtol), f"{what}, iteration {it}: {got[it]} vs {want[it]}"


@pytest.mark.parametrize("reference", ["1f1b", "dualpipev", "ep2dp4"])
def test_replacement_keeps_losses(jobs: dict[str, Any], reference: str) -> None:
    plain, eplb = jobs[reference], jobs[f"{reference}_eplb"]
    assert sorted(plain["loss"]) == list(range(1, ITERS + 1))
    _equal(eplb["loss"], plain["loss"], LOSS_RTOL, f"{reference} lm loss with EPLB")
    _equal(eplb["grad_norm"], plain["grad_norm"], NORM_RTOL, f"{reference} grad norm with EPLB")
    # Re-planned after iterations 2, 4, 6; experts really moved, and each move was measured.
    moves = eplb["moves"]
    assert [m[0] for m in moves] == [2, 4, 6], eplb["log"][-3000:]
    assert all(n > 0 for _, n, _, _ in moves), moves
    assert all(m for *_, m in moves), f"a move without its measured load: {moves}"
    # The load metric is logged every iteration with EPLB, and not at all without it.
    assert sorted(eplb["metric"]) == list(range(1, ITERS + 1)) and all(v >= 1 for v in eplb["metric"].values())
    assert not plain["metric"]
    # Redundant experts: replicas checked bitwise before every iteration, and they did compute.
    assert [i for _, i in eplb["checked"]] == list(range(1, ITERS + 1)), eplb["log"][-3000:]
    assert all(n > 0 for n, _ in eplb["checked"])
    assert len(eplb["replica_tokens"]) == ITERS and sum(eplb["replica_tokens"]) > 0
    assert "EPLB redundant experts: 2 extra slots per MoE layer (10 compute slots for 8 experts)" in eplb["log"]


def _after_resume(full: dict[int, float]) -> dict[int, float]:
    """The uninterrupted run's losses as the resumed run logs them: Megatron's second log line
    after a resume averages two iterations (see test_megatron_training.py)."""
    first, second = RESUME_FROM + 1, RESUME_FROM + 2
    want = {i: full[i] for i in range(first, ITERS + 1)}
    want[second] = (full[first] + full[second]) / 2
    return want


def test_checkpoint_after_a_move_resumes_without_eplb(jobs: dict[str, Any]) -> None:
    resumed, full = jobs["dualpipev_eplb_resumed_without_eplb"], jobs["dualpipev_eplb"]
    _equal(resumed["loss"], _after_resume(full["loss"]), LOSS_RTOL, "resumed lm loss")
    _equal(resumed["grad_norm"], {i: full["grad_norm"][i] for i in range(RESUME_FROM + 1, ITERS + 1)},
           NORM_RTOL, "resumed grad norm")
    assert not resumed["moves"] and not resumed["resumed"]


def test_checkpoint_resumes_with_eplb_restoring_its_placement(jobs: dict[str, Any]) -> None:
    resumed, full = jobs["dualpipe_resumed_with_eplb"], jobs["dualpipev_eplb"]
    _equal(resumed["loss"], _after_resume(full["loss"]), LOSS_RTOL, "resumed lm loss")
    [(window, placement)] = resumed["resumed"]
    assert int(window) == RESUME_FROM and "experts moved" in placement, placement
    assert [m[0] for m in resumed["moves"]] == [6]
    assert [i for _, i in resumed["checked"]] == list(range(RESUME_FROM + 1, ITERS + 1))


def test_checkpoint_without_redundancy_resumes_with_it(jobs: dict[str, Any]) -> None:
    resumed, full = jobs["dualpipev_resumed_with_redundancy"], jobs["dualpipev"]
    _equal(resumed["loss"], _after_resume(full["loss"]), LOSS_RTOL, "resumed lm loss")
    assert [m[0] for m in resumed["moves"]] == [6] and sum(resumed["replica_tokens"]) > 0


def test_checkpoint_holds_load_and_placement(jobs: dict[str, Any]) -> None:
    out: Path = jobs["out"]
    saved = json.loads((out / "ckpt" / f"iter_{RESUME_FROM:07d}" / "eplb.json").read_text())
    assert saved["iteration"] == RESUME_FROM and saved["layers"] == list(range(1, 9))
    assert len(saved["history"]) == RESUME_FROM  # window 4, iterations 1-4
    placement = saved["placement"]  # 10 compute slots per layer: every expert, two of them twice
    assert all(len(row) == 10 and set(row) == set(range(8)) for row in placement)
    assert any(row != [0, 1, 2, 3, 4, 4, 5, 6, 7, 0] for row in placement), "no move before the save"
    # Top-2 routing of 16 samples x 8 tokens: every layer routes 2 x 128 tokens per iteration.
    assert all(sum(layer) == 256 for counts in saved["history"] for layer in counts)


@pytest.mark.parametrize("name", ["1f1b_eplb", "dualpipev_eplb"])
def test_stats_file(jobs: dict[str, Any], name: str) -> None:
    stats, whole = read_stats_file(jobs["out"] / f"{name}_stats.json")
    assert whole["iteration"] == ITERS and len(stats.history) == 4 and whole["ep_size"] == 2
    assert stats.layers == list(range(1, 9)) and all(sum(layer) == 256 for layer in whole["history"][-1])
    assert whole["placement"] != [list(range(8))] * 8


def test_hierarchical_placement_is_deepseeks_plan_with_groups_on_one_node(jobs: dict[str, Any]) -> None:
    """Each re-plan's placement is ``rebalance_experts(load, slots, G, N, EP)`` of the logged
    load, renumbered only within nodes (and nodes as wholes), and each group's experts (all their
    copies) lie on one node, before and after every move; losses equal the run without EPLB."""
    plain, eplb = jobs["ep4_groups"], jobs["ep4_groups_hierarchical"]
    _equal(eplb["loss"], plain["loss"], LOSS_RTOL, "lm loss with hierarchical EPLB")
    _equal(eplb["grad_norm"], plain["grad_norm"], NORM_RTOL, "grad norm with hierarchical EPLB")
    assert ("EPLB placement: hierarchical policy: 2 expert groups over 2 node(s) of 2 EP rank(s), "
            "each group on one node") in eplb["log"]
    plans = eplb["plans"]
    assert sorted(plans) == [2, 4, 6], eplb["log"][-3000:]
    nodes = ((0, 1), (2, 3))
    layout = NodeLayout(nodes)
    previous = initial_slots(8, HIERARCHICAL_SLOTS - 8, 4, nodes).repeat(8, 1).tolist()
    adopted = 0
    for iteration, plan in sorted(plans.items()):
        assert plan["groups"] == GROUPS and plan["nodes"] == [list(n) for n in nodes]
        assert plan["num_slots"] == HIERARCHICAL_SLOTS
        load = torch.tensor(plan["load"], dtype=torch.float64)
        for layer, (aligned, placed) in enumerate(zip(plan["aligned"], plan["placement"])):
            deepseek = rebalance_experts(load[layer:layer + 1], HIERARCHICAL_SLOTS, GROUPS, NODES, 4)[0][0]
            assert node_form(aligned, nodes) == planner_form(deepseek.tolist(), NODES, 4), (iteration, layer)
            assert placed in (aligned, previous[layer]), (iteration, layer)  # adopted, or kept by the guard
            assert layout.keeps_groups(torch.tensor(placed), GROUPS, 8), (iteration, layer, placed)
            adopted += placed == aligned and placed != previous[layer]
        previous = plan["placement"]
    assert adopted > 0, "no layer was re-placed"
    assert [m[0] for m in eplb["moves"]] == [2, 4, 6] and [i for _, i in eplb["checked"]] == list(range(1, ITERS + 1))
