"""MoE GPT through ``scripts/pretrain_gpt.py``: DualPipeV with the overlapped F&B equals it without
the overlap and equals Megatron's 1F1B, and so does DualPipe with the overlap (4 CPU processes:
EP=2 x P=2, gloo, mock data).

Model: 8 layers, 4 experts, top-2, alltoall dispatcher, aux loss on. Every run starts from one
checkpoint written at PP=1 x EP=2 with learning rate 0 and trains iterations 2..4 (three
iterations), M=8 micro-batches per step. Compared per iteration: ``lm loss`` (relative 1e-5),
the load-balancing loss and the grad norm (relative 1e-4: the grad norm is a sum of squares
over all parameters, reduced in another order under DualPipeV).

Precision: fp32 for the 1F1B comparison (our overlap path has no bf16 requirement, and fp32
keeps the tolerances tight), and bf16 with ``--overlap-moe-expert-parallel-comm`` (Megatron's
flag; under our schedules it asks for our overlap) against Megatron's interleaved schedule
(VPP=2) with its own combined-1F1B EP overlap, which needs bf16 and a virtual pipeline.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pretrain_runs import TRAIN, RunFailed, grad_norms, losses, run

MOE = ("--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
       "--moe-aux-loss-coeff 1e-2 --disable-bias-linear --expert-model-parallel-size 2").split()
P2 = ["--pipeline-model-parallel-size", "2"]
BF16 = ["--bf16", "--overlap-moe-expert-parallel-comm"]
ITERS = ["--train-iters", "4"]
AUX = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?load_balancing_loss: ([0-9.E+-]+)")
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4

RUNS = {
    "1f1b": [*P2, "--pipeline-schedule", "1f1b"],
    "dualpipev_overlap": [*P2, "--pipeline-schedule", "dualpipev"],
    "dualpipev_no_overlap": [*P2, "--pipeline-schedule", "dualpipev", "--no-dualpipe-moe-overlap"],
    "dualpipe_overlap": [*P2, "--pipeline-schedule", "dualpipe"],
    # bf16, which Megatron's own EP overlap requires (and with it a virtual pipeline).
    "megatron_interleaved_overlap_bf16": [*P2, *BF16, "--num-layers-per-virtual-pipeline-stage", "2"],
    "dualpipev_overlap_bf16": [*P2, *BF16, "--pipeline-schedule", "dualpipev"],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[int, float]]]:
    out = tmp_path_factory.mktemp("moe_pretrain")
    init = out / "init"
    got: dict[str, dict[str, dict[int, float]]] = {}
    try:
        run("init", out, 2, [*MOE, "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                             "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
                             "--save", str(init), "--save-interval", "1"])
        start = [*MOE, "--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN, *ITERS]
        for name, args in RUNS.items():
            log = run(name, out, 4, [*start, *args])
            got[name] = {"loss": losses(log), "grad_norm": grad_norms(log),
                         "aux": {int(i): float(v) for i, v in AUX.findall(log)},
                         "announced": _announcement(log)}
    except RunFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _announcement(log: str) -> dict[int, float]:
    """{overlapped FB ops, FB ops} from the schedule's one-time line on rank 0 (empty if absent)."""
    found = re.search(r"DualPipe MoE F&B overlap on: (\d+) of (\d+) FB ops", log)
    return {0: float(found.group(1)), 1: float(found.group(2))} if found else {}


def _same(ref: dict[int, float], got: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(ref) == [2, 3, 4], (sorted(ref), sorted(got))
    for i in ref:
        assert got[i] == pytest.approx(ref[i], rel=rtol), f"iteration {i}: {got[i]} vs {ref[i]}"


def test_reference_trains(jobs: dict) -> None:
    ref = jobs["1f1b"]
    assert ref["loss"][4] < ref["loss"][2], ref["loss"]
    assert sorted(ref["aux"]) == [2, 3, 4], "load-balancing loss not logged"


@pytest.mark.parametrize("name", ["dualpipev_overlap", "dualpipev_no_overlap", "dualpipe_overlap"])
@pytest.mark.parametrize("metric,rtol", [("loss", LOSS_RTOL), ("aux", LOSS_RTOL), ("grad_norm", NORM_RTOL)])
def test_dualpipev_matches_1f1b(jobs: dict, name: str, metric: str, rtol: float) -> None:
    _same(jobs["1f1b"][metric], jobs[name][metric], rtol)


@pytest.mark.parametrize("metric,rtol", [("loss", LOSS_RTOL), ("aux", LOSS_RTOL), ("grad_norm", NORM_RTOL)])
def test_bf16_dualpipev_matches_megatron_ep_overlap(jobs: dict, metric: str, rtol: float) -> None:
    _same(jobs["megatron_interleaved_overlap_bf16"][metric], jobs["dualpipev_overlap_bf16"][metric], rtol)


@pytest.mark.parametrize("metric", ["loss", "aux", "grad_norm"])
def test_overlap_on_equals_off(jobs: dict, metric: str) -> None:
    _same(jobs["dualpipev_no_overlap"][metric], jobs["dualpipev_overlap"][metric], 0.0)


def test_overlap_really_ran(jobs: dict) -> None:
    """Every FB op of the overlap run went through Megatron's combined step (else on == off would
    be vacuous); the run with the flag off never did."""
    for name in ("dualpipev_overlap", "dualpipe_overlap", "dualpipev_overlap_bf16"):
        announced = jobs[name]["announced"]
        assert announced and announced[0] == announced[1] > 0, (name, announced)
    assert jobs["dualpipev_no_overlap"]["announced"] == {}
