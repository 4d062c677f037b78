"""Dense-then-MoE GPT through ``scripts/pretrain_gpt.py``: DualPipeV with the overlapped F&B equals
it without the overlap and equals Megatron's 1F1B, and so does DualPipe with the overlap (4 CPU
processes: EP=2 x P=2, gloo, mock data).

Model: 8 layers, layer 1 dense and layers 2-8 MoE (``--moe-layer-freq ([0]*1+[1]*7)``), 4 experts,
top-2, alltoall dispatcher, aux loss on, and one MTP layer at the loss stage (its inner layer is
MoE, so it runs in the overlap's plans), RoPE, untied output layer. Under DualPipeV rank 0's first chunk mixes the dense
layer 1 with the MoE layer 2, and under DualPipe its first chunk holds layers 1-4: such chunks
overlap too (the dense layer runs in the plan as compute only), and the overlap's one-time line
on rank 0 names each chunk's dense and MoE layers. Every run starts from one
checkpoint written at PP=1 x EP=2 with learning rate 0 and trains iterations 2..4 (three
iterations), M=8 micro-batches per step. The DualPipe run also re-places experts with EPLB
after iterations 2 and 3 (so its equality with 1F1B covers moved experts), and it and the
interleaved run write EPLB statistics, which must count every routed token exactly once. Compared per iteration: ``lm loss`` (relative 1e-5),
the load-balancing loss, the MTP loss and the grad norm (relative 1e-4: the grad norm is a sum of squares
over all parameters, reduced in another order under DualPipeV).

Precision: fp32 for the 1F1B comparison (our overlap path has no bf16 requirement, and fp32
keeps the tolerances tight), and bf16 with ``--overlap-moe-expert-parallel-comm`` (Megatron's
flag; under our schedules it asks for our overlap) against Megatron's interleaved schedule
(VPP=2) with its own combined-1F1B EP overlap, which needs bf16 and a virtual pipeline (its first
virtual stage holds the dense layer 1 and the MoE layer 2 as well).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from launcher import LaunchFailed
from pretrain_runs import TRAIN, grad_norms, losses, run

pytestmark = pytest.mark.multiprocess

MOE = ("--num-experts 4 --moe-layer-freq ([0]*1+[1]*7) --moe-router-topk 2 "
       "--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2 --disable-bias-linear "
       "--expert-model-parallel-size 2 "
       # DeepSeek-V3's MTP module (an MoE layer here), hence RoPE and an untied head (test_megatron_mtp.py).
       "--mtp-num-layers 1 --position-embedding-type rope --untie-embeddings-and-output-weights").split()
P2 = ["--pipeline-model-parallel-size", "2"]
BF16 = ["--bf16", "--overlap-moe-expert-parallel-comm"]
ITERS = ["--train-iters", "4"]
AUX = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?load_balancing_loss: ([0-9.E+-]+)")
MTP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?mtp_1 loss: ([0-9.E+-]+)")
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4
ANNOUNCED = re.compile(r"DualPipe MoE F&B overlap on: (\d+) of (\d+) FB ops[^;\n]*(?:; (.*))?")
DENSE, MOE_LAYERS = "dense (compute only)", "MoE (EP all-to-all overlapped)"
# Rank 0's chunks: DualPipeV P=2 holds stages 0 and 3 of four (2 layers each), DualPipe P=2
# stage 0 of one direction and stage 1 of the other (4 layers each).
V_LAYERS = (f"chunk 0: layer 1 {DENSE}, layer 2 {MOE_LAYERS}; "
            f"chunk 1: layers 7-8 {MOE_LAYERS}, MTP layer 1 {MOE_LAYERS}")
LAYERS = {"dualpipev_overlap": V_LAYERS, "dualpipev_overlap_bf16": V_LAYERS,
          "dualpipe_overlap": (f"chunk 0: layer 1 {DENSE}, layers 2-4 {MOE_LAYERS}; "
                               f"chunk 1: layers 5-8 {MOE_LAYERS}, MTP layer 1 {MOE_LAYERS}")}

RUNS = {
    "1f1b": [*P2, "--pipeline-schedule", "1f1b"],
    "dualpipev_overlap": [*P2, "--pipeline-schedule", "dualpipev"],
    "dualpipev_no_overlap": [*P2, "--pipeline-schedule", "dualpipev", "--no-dualpipe-moe-overlap"],
    "dualpipe_overlap": [*P2, "--pipeline-schedule", "dualpipe"],
    # bf16, which Megatron's own EP overlap requires (and with it a virtual pipeline).
    "megatron_interleaved_overlap_bf16": [*P2, *BF16, "--num-layers-per-virtual-pipeline-stage", "2"],
    "dualpipev_overlap_bf16": [*P2, *BF16, "--pipeline-schedule", "dualpipev"],
}


# EPLB statistics under Megatron's interleaved schedule and DualPipe (both chunks of a rank, both
# copies of a layer), and re-placement after iterations 2 and 3 under DualPipe with the overlap:
# its comparisons with 1F1B then cover moved experts too (tests/test_eplb_training.py has the rest).
EPLB = {"dualpipe_overlap": ["--eplb-interval", "1", "--eplb-threshold", "0"]}
STATS = ("dualpipe_overlap", "megatron_interleaved_overlap_bf16")
MOE_LAYER_NUMBERS = [2, 3, 4, 5, 6, 7, 8, 9]  # layers 2-8, then the MTP layer
ROUTED_PER_ITERATION = 2 * 16 * 8  # top-2 x global batch 16 x sequence 8


def _stats_file(out, name: str) -> list[str]:
    return ["--eplb-stats-file", str(out / f"{name}_eplb.json")] if name in STATS else []


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("moe_pretrain")
    init = out / "init"
    got: dict[str, dict[str, Any]] = {}
    try:
        run("init", out, 2, [*MOE, "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                             "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
                             "--save", str(init), "--save-interval", "1"])
        start = [*MOE, "--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN, *ITERS]
        for name, args in RUNS.items():
            log = run(name, out, 4, [*start, *args, *EPLB.get(name, []), *_stats_file(out, name)])
            got[name] = {"loss": losses(log), "grad_norm": grad_norms(log),
                         "aux": {int(i): float(v) for i, v in AUX.findall(log)},
                         "mtp": {int(i): float(v) for i, v in MTP.findall(log)},
                         "announced": _announcement(log), "log": log, "out": out}
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _announcement(log: str) -> tuple[int, int, str] | None:
    """(overlapped FB ops, FB ops, what ran how per chunk) from the overlap's one-time line on rank 0."""
    found = ANNOUNCED.search(log)
    return (int(found.group(1)), int(found.group(2)), found.group(3) or "") if found else None


def _same(ref: dict[int, float], got: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(ref) == [2, 3, 4], (sorted(ref), sorted(got))
    for i in ref:
        assert got[i] == pytest.approx(ref[i], rel=rtol), f"iteration {i}: {got[i]} vs {ref[i]}"


def test_reference_trains(jobs: dict) -> None:
    ref = jobs["1f1b"]
    assert ref["loss"][4] < ref["loss"][2], ref["loss"]
    assert sorted(ref["aux"]) == [2, 3, 4], "load-balancing loss not logged"
    assert sorted(ref["mtp"]) == [2, 3, 4], "MTP loss not logged"


@pytest.mark.parametrize("name", ["dualpipev_overlap", "dualpipev_no_overlap", "dualpipe_overlap"])
@pytest.mark.parametrize("metric,rtol", [("loss", LOSS_RTOL), ("aux", LOSS_RTOL), ("mtp", LOSS_RTOL),
                                         ("grad_norm", NORM_RTOL)])
def test_dualpipev_matches_1f1b(jobs: dict, name: str, metric: str, rtol: float) -> None:
    _same(jobs["1f1b"][metric], jobs[name][metric], rtol)


@pytest.mark.parametrize("metric,rtol", [("loss", LOSS_RTOL), ("aux", LOSS_RTOL), ("mtp", LOSS_RTOL),
                                         ("grad_norm", NORM_RTOL)])
def test_bf16_dualpipev_matches_megatron_ep_overlap(jobs: dict, metric: str, rtol: float) -> None:
    _same(jobs["megatron_interleaved_overlap_bf16"][metric], jobs["dualpipev_overlap_bf16"][metric], rtol)


@pytest.mark.parametrize("metric", ["loss", "aux", "mtp", "grad_norm"])
def test_overlap_on_equals_off(jobs: dict, metric: str) -> None:
    _same(jobs["dualpipev_no_overlap"][metric], jobs["dualpipev_overlap"][metric], 0.0)


def test_overlap_really_ran(jobs: dict) -> None:
    """Every FB op of the overlap run went through Megatron's combined step (else on == off would
    be vacuous); the run with the flag off never did."""
    for name in LAYERS:
        announced = jobs[name]["announced"]
        assert announced and announced[0] == announced[1] > 0, (name, announced)
    assert jobs["dualpipev_no_overlap"]["announced"] is None


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_log_names_dense_and_moe_layers(jobs: dict, name: str) -> None:
    """Chunks mixing the dense layer with MoE layers overlapped too, and the log says which layers
    hid their all-to-alls and which ran as compute only."""
    announced = jobs[name]["announced"]
    assert announced and announced[2] == LAYERS[name], (name, announced)


@pytest.mark.parametrize("name", STATS)
def test_eplb_counts_every_routed_token_once(jobs: dict, name: str) -> None:
    from dualpipe_megatron.eplb.stats import read_stats_file

    stats, whole = read_stats_file(jobs[name]["out"] / f"{name}_eplb.json")
    assert stats.layers == MOE_LAYER_NUMBERS and whole["iteration"] == 4 and len(stats.history) == 3
    for counts in stats.history:
        assert counts.sum(dim=1).tolist() == [ROUTED_PER_ITERATION] * len(MOE_LAYER_NUMBERS), counts


def test_eplb_moved_experts_under_dualpipe(jobs: dict) -> None:
    moved = re.findall(r"^EPLB iteration (\d+): moved (\d+) experts", jobs["dualpipe_overlap"]["log"], re.M)
    assert [int(i) for i, _ in moved] == [2, 3] and any(int(n) for _, n in moved), moved
