"""Multi-token prediction (``--mtp-num-layers``) through ``scripts/pretrain_gpt.py`` under
DualPipeV and DualPipe equals Megatron's 1F1B (CPU processes, gloo, mock data).

The MTP block sits at the loss stage with its own embedding copy, tied locally: DualPipeV's
rank 0, each DualPipe direction's last stage; under 1F1B it is on the last rank and tied
through Megatron's embedding group. RoPE positions (an MTP block with learned absolute
positions would hold a second, untied position table when the pipeline is split, unlike the
PP=1 model the runs start from).

- N=1 at P=2 and N=2 at P=4, each from one PP=1 checkpoint (learning rate 0): ``lm loss`` and
  every ``mtp_k loss`` at every iteration equal to the printed digits under DualPipeV (the same
  reduction order as 1F1B) and to relative 1e-6 under DualPipe (mirrored copies summed in
  another order), grad norms to relative 1e-4 (a sum of squares over all parameters, reduced in
  another order); DualPipeV at P=2 with
  ``--dualpipe-layout auto``, which puts the MTP layer's weight on rank 0 and chooses an uneven
  split (``Ett|tt|ttt|tmL``);
- at P=2 a DualPipeV checkpoint resumes under 1F1B and a 1F1B one under DualPipeV with the
  uninterrupted run's losses and grad norms.
"""

from __future__ import annotations

import re

import pytest

from launcher import LaunchFailed
from pretrain_runs import TRAIN, grad_norms, losses, run

pytestmark = pytest.mark.multiprocess

# DeepSeek-V3 unties them; Megatron 0.19 cannot checkpoint a tied output layer next to MTP at PP > 1.
ROPE = ["--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")
MTP_LOSS = re.compile(r"mtp_(\d+) loss: ([0-9.E+-]+)")
# Losses by reduction order: DualPipeV accumulates every gradient in 1F1B's order, so its printed
# digits are exact; DualPipe sums each stage's two mirrored copies (half the micro-batches each),
# a different order whose last-bit differences show in the printed digits on some CPUs.
LOSS_RTOL = {"dualpipev": 0.0, "dualpipe": 1e-6}
NORM_RTOL = 1e-4  # a sum of squares over all parameters, reduced in another order
SCHEDULES = ("1f1b", "dualpipev", "dualpipe")
# (MTP layers, pipeline size, training iterations after the initial one)
SHAPES = {"n1_p2": (1, 2, 5), "n2_p4": (2, 4, 4)}
SAVE_AT = 3  # the P=2 runs of 1f1b and dualpipev save here; resumes train 4..5
# DualPipeV at P=2 places layers with --dualpipe-layout auto: the FLOP model weighs the MTP
# layer and the output layers on rank 0 and moves a decoder layer to rank 1.
AUTO = {"dualpipev_n1_p2": ["--dualpipe-layout", "auto"]}
AUTO_CHOSE = "dualpipe: --dualpipe-layout auto chose Ett|tt|ttt|tmL"


def mtp_losses(log: str) -> dict[int, dict[int, float]]:
    """{depth: {iteration: loss}} from Megatron's per-iteration log lines."""
    got: dict[int, dict[int, float]] = {}
    for line in log.splitlines():
        it = ITERATION.search(line)
        for depth, value in MTP_LOSS.findall(line) if it else ():
            got.setdefault(int(depth), {})[int(it.group(1))] = float(value)
    return got


def _record(log: str) -> dict:
    return {"loss": losses(log), "grad_norm": grad_norms(log), "mtp": mtp_losses(log)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("mtp_pretrain")
    got: dict[str, dict] = {}
    try:
        for shape, (layers, pp, iters) in SHAPES.items():
            mtp = [*ROPE, "--mtp-num-layers", str(layers)]
            init = out / f"init_{shape}"
            run(f"init_{shape}", out, 1, [*mtp, "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                                          "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
                                          "--save", str(init), "--save-interval", "1"])
            start = [*mtp, "--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN,
                     "--train-iters", str(1 + iters), "--pipeline-model-parallel-size", str(pp)]
            for schedule in SCHEDULES:
                name = f"{schedule}_{shape}"
                save = (["--save", str(out / name), "--save-interval", str(SAVE_AT)]
                        if pp == 2 and schedule != "dualpipe" else [])
                log = run(name, out, pp, [*start, "--pipeline-schedule", schedule, *save, *AUTO.get(name, [])])
                got[name] = {**_record(log), "auto_layout": AUTO_CHOSE in log}
        layers, pp, iters = SHAPES["n1_p2"]
        resume = [*ROPE, "--mtp-num-layers", str(layers), *TRAIN, "--train-iters", str(1 + iters),
                  "--pipeline-model-parallel-size", str(pp), "--no-load-rng", "--ckpt-step", str(SAVE_AT)]
        for name, saved, schedule in (("v_to_1f1b", "dualpipev_n1_p2", "1f1b"),
                                      ("1f1b_to_v", "1f1b_n1_p2", "dualpipev")):
            got[name] = _record(run(name, out, pp, [*resume, "--load", str(out / saved),
                                                    "--pipeline-schedule", schedule]))
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _same(ref: dict[int, float], got: dict[int, float], iterations: list[int], rtol: float) -> None:
    assert [i for i in iterations if i not in ref or i not in got] == [], (sorted(ref), sorted(got))
    for i in iterations:
        assert got[i] == pytest.approx(ref[i], rel=rtol), f"iteration {i}: {got[i]} vs {ref[i]}"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_logs_every_mtp_depth(jobs: dict, shape: str) -> None:
    layers, _, iters = SHAPES[shape]
    ref = jobs[f"1f1b_{shape}"]
    assert sorted(ref["mtp"]) == list(range(1, layers + 1)), "MTP losses not logged"
    for depth in ref["mtp"].values():
        assert sorted(depth) == list(range(2, 2 + iters))
    assert ref["loss"][1 + iters] < ref["loss"][2]


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_1f1b(jobs: dict, schedule: str, shape: str) -> None:
    layers, _, iters = SHAPES[shape]
    ref, got = jobs[f"1f1b_{shape}"], jobs[f"{schedule}_{shape}"]
    its = list(range(2, 2 + iters))
    _same(ref["loss"], got["loss"], its, LOSS_RTOL[schedule])
    _same(ref["grad_norm"], got["grad_norm"], its, NORM_RTOL)
    assert sorted(got["mtp"]) == list(range(1, layers + 1))
    for depth in range(1, layers + 1):
        _same(ref["mtp"][depth], got["mtp"][depth], its, LOSS_RTOL[schedule])


def test_auto_layout_chose_an_uneven_split(jobs: dict) -> None:
    assert jobs["dualpipev_n1_p2"]["auto_layout"], f"no '{AUTO_CHOSE}' in the log"


@pytest.mark.parametrize("resumed", ["v_to_1f1b", "1f1b_to_v"])
def test_checkpoints_move_between_schedules(jobs: dict, resumed: str) -> None:
    """The first iteration after the resume logs the uninterrupted run's losses; Megatron's next
    log averages two iterations after a resume (see test_megatron_training.py), so from there on
    the grad norms are compared."""
    ref, got = jobs["1f1b_n1_p2"], jobs[resumed]
    _, _, iters = SHAPES["n1_p2"]
    first = SAVE_AT + 1
    _same(ref["loss"], got["loss"], [first], LOSS_RTOL["dualpipev"])
    _same(ref["mtp"][1], got["mtp"][1], [first], LOSS_RTOL["dualpipev"])
    _same(ref["grad_norm"], got["grad_norm"], list(range(first, 2 + iters)), NORM_RTOL)
