"""Tensor and sequence parallelism under DualPipeV and DualPipe, through ``scripts/pretrain_gpt.py``
(4 CPU processes, gloo, mock data): every run equals Megatron's 1F1B at the same parallel sizes.

Dense GPT at TP=2 x P=2 without sequence parallelism, and MoE GPT at TP=2 x EP=2 x P=2 with
``--sequence-parallel`` (p2p shapes of a sequence shard; the weight-grad split of
sequence-parallel linears, announced once in the log; torch norms marked for the TP grad sum by
the CPU compatibility layer; ``--expert-tensor-parallel-size 1``, so that EP x ETP divides TP x DP
on 4 processes; Megatron requires sequence parallelism for MoE with TP) with the MoE F&B overlap
on. Each model's runs start
from one checkpoint written at TP=2 x PP=1 with learning rate 0 and train iterations 2..4, M=8
micro-batches per step. Compared per iteration: ``lm loss`` and the load-balancing loss (relative
1e-5), the grad norm (relative 1e-4: reduced in another order under our schedules).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from launcher import LaunchFailed
from pretrain_runs import TRAIN, grad_norms, losses, run

pytestmark = pytest.mark.multiprocess

TP2 = ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"]
SP = ["--sequence-parallel"]
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2 "
       "--disable-bias-linear --expert-model-parallel-size 2 --expert-tensor-parallel-size 1").split() + SP
SCHEDULES = ("1f1b", "dualpipev", "dualpipe")
OURS = SCHEDULES[1:]
# Run name -> (the checkpoint it starts from, its flags).
MODELS = {"dense": ("dense", []), "moe": ("moe", MOE)}
AUX = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?load_balancing_loss: ([0-9.E+-]+)")
OVERLAP = re.compile(r"DualPipe MoE F&B overlap (on|off)\b.*")
SP_DEFERRAL = "DualPipe weight-grad split: sequence-parallel linears defer their weight grads to W"
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4


def _init(out: Path, name: str, model: list[str]) -> Path:
    path = out / f"init_{name}"
    run(f"init_{name}", out, 2, [*TP2, *model, "--train-iters", "1", "--lr", "0", "--min-lr", "0",
                                 "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
                                 "--save", str(path), "--save-interval", "1"])
    return path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("tp_pretrain")
    got: dict[str, dict[str, Any]] = {}
    try:
        inits = {"dense": _init(out, "dense", []), "moe": _init(out, "moe", MOE)}
        for model, (init, flags) in MODELS.items():
            start = [*TP2, *flags, "--pipeline-model-parallel-size", "2", "--load", str(inits[init]),
                     "--no-load-optim", "--no-load-rng", *TRAIN, "--train-iters", "4"]
            for schedule in SCHEDULES:
                log = run(f"{model}_{schedule}", out, 4, [*start, "--pipeline-schedule", schedule])
                got[f"{model}_{schedule}"] = {
                    "loss": losses(log), "grad_norm": grad_norms(log),
                    "aux": {int(i): float(v) for i, v in AUX.findall(log)},
                    "overlap": [m.group(0) for m in OVERLAP.finditer(log)],
                    "sp_deferral": SP_DEFERRAL in log,
                }
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _same(ref: dict[int, float], got: dict[int, float], rtol: float) -> None:
    assert sorted(got) == sorted(ref) == [2, 3, 4], (sorted(ref), sorted(got))
    for i in ref:
        assert got[i] == pytest.approx(ref[i], rel=rtol), f"iteration {i}: {got[i]} vs {ref[i]}"


@pytest.mark.parametrize("model", list(MODELS))
def test_reference_trains(jobs: dict, model: str) -> None:
    ref = jobs[f"{model}_1f1b"]["loss"]
    assert sorted(ref) == [2, 3, 4] and ref[4] < ref[2], ref


@pytest.mark.parametrize("schedule", OURS)
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("metric,rtol", [("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)])
def test_matches_1f1b(jobs: dict, model: str, schedule: str, metric: str, rtol: float) -> None:
    _same(jobs[f"{model}_1f1b"][metric], jobs[f"{model}_{schedule}"][metric], rtol)


@pytest.mark.parametrize("schedule", OURS)
def test_moe_load_balancing_loss_matches_1f1b(jobs: dict, schedule: str) -> None:
    _same(jobs["moe_1f1b"]["aux"], jobs[f"moe_{schedule}"]["aux"], LOSS_RTOL)


@pytest.mark.parametrize("schedule", OURS)
def test_features_really_ran(jobs: dict, schedule: str) -> None:
    """The MoE runs overlapped F&B with TP (every FB op) and deferred the sequence-parallel
    linears' weight grads (the dense runs without SP had none to defer)."""
    overlap = jobs[f"moe_{schedule}"]["overlap"]
    assert overlap and overlap[0].startswith("DualPipe MoE F&B overlap on"), overlap
    counts = re.match(r"DualPipe MoE F&B overlap on: (\d+) of (\d+) FB ops", overlap[0])
    assert counts and counts.group(1) == counts.group(2) != "0", overlap[0]
    assert jobs[f"moe_{schedule}"]["sp_deferral"]
    assert not jobs[f"dense_{schedule}"]["sp_deferral"]
