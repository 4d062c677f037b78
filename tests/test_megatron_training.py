"""``--pipeline-schedule`` through ``megatron.training.pretrain`` (4 CPU processes, gloo, mock data).

``scripts/pretrain_gpt.py`` builds its model through a config container, as Megatron-LM 0.19's
own script does (the builder route, ``build_virtual_pipeline_stages``); the P=2 x DP=2 runs are
repeated under both schedules through ``tests/legacy_pretrain_gpt.py``, which passes a
``model_provider`` (the legacy route, ``training.get_model``).

All runs start from one PP=1 checkpoint and train iterations 2..7. Under dualpipev and dualpipe
the logged ``lm loss`` must equal 1F1B's at every iteration (1e-5 relative), at P=4 and at
P=2 x DP=2 with the distributed optimizer and overlapped grad reduce (DualPipeV there with the
op order optimized for uniform costs, and at P=4 from a schedule file with an activation budget below DeepSeek's
peak); a DualPipeV checkpoint saved at iteration 4 at P=4 resumes
under 1F1B at P=2 x DP=2 with the losses of the uninterrupted run (test_megatron_mtp.py resumes
DualPipeV under 1F1B and 1F1B under DualPipeV at P=2). (The refusal of a distributed-optimizer state saved under another schedule
is unit-tested in test_megatron_layout.py: resuming a distributed optimizer fails inside
Megatron on CPU with torch's Adam, before any schedule check could run.)
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.events import peak_live_activations
from dualpipe_megatron.schedules.order_file import read_schedule_file
from dualpipe_megatron.trace.records import load, pipelines, step_schedule
from launcher import LaunchFailed
from pretrain_runs import REPO, TRAIN, eval_losses, grad_norms, init_checkpoint, losses, run

pytestmark = pytest.mark.multiprocess

ITERS = ["--train-iters", "7"]
RTOL = 1e-5
P4 = ["--pipeline-model-parallel-size", "4"]
P2DP2 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce"]
LAUNCH = ["-m", "dualpipe_megatron.launch", str(REPO / "tests" / "stock_pretrain_gpt.py")]
LEGACY_SCRIPT = REPO / "tests" / "legacy_pretrain_gpt.py"


EVAL_FLAGS = ["--eval-iters", "1", "--eval-interval", "3"]
# The P=2 x DP=2 DualPipeV run uses the op order optimized for uniform costs (M=8: 50 -> 49
# simulated), so its equality with 1F1B covers an optimized order too.
OPTIMIZED = {"dualpipev": ["--dualpipe-optimize-order"]}
OPTIMIZED_LINE = re.compile(r"DualPipe op order optimized \(dualpipev, P=2, M=8\): simulated step ([0-9.]+) -> ([0-9.]+)")
# The P=4 DualPipeV run (through the launcher) runs an order from a schedule file: the one
# `dualpipe-schedules dump --optimize` finds within an activation budget of 3/4 of DeepSeek's peak
# at M=16 (DeepSeek's order peaks at 9 live stage activations on a rank), so its equality with
# 1F1B covers a budgeted order from a file too; its trace shows the file's order ran.
BUDGET = 7
P4_ORDER = ["--schedule", "dualpipev", "--ranks", "4", "--microbatches", "16", "--optimize",
            "--max-activations", str(BUDGET)]


def _order_file(out: Path) -> Path:
    """What ``dualpipe-schedules dump`` writes for the P=4 DualPipeV run, in a file."""
    dump = subprocess.run([sys.executable, "-m", "dualpipe_megatron.schedules", "dump", *P4_ORDER], cwd=REPO,
                          capture_output=True, text=True, check=True)
    path = out / "dualpipev_p4_order.json"
    path.write_text(dump.stdout)
    return path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("pretrain")
    init = init_checkpoint(out)
    start = ["--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN, *ITERS]
    got: dict[str, dict] = {"order_file": _order_file(out), "dualpipev_p4_trace": out / "dualpipev_p4_trace"}
    budgeted = {"dualpipev_p4": ["--dualpipe-schedule-file", str(got["order_file"]),
                                 "--dualpipe-trace", str(got["dualpipev_p4_trace"])]}
    try:
        for name, args in (("1f1b_p4", [*P4, "--pipeline-schedule", "1f1b"]),
                           ("dualpipev_p4", [*P4, "--pipeline-schedule", "dualpipev"]),
                           ("dualpipe_p4", [*P4, "--pipeline-schedule", "dualpipe"])):
            save = ["--save", str(out / name), "--save-interval", "4", *EVAL_FLAGS]
            command = LAUNCH if name == "dualpipev_p4" else None
            log = run(name, out, 4, [*start, *args, *save, *budgeted.get(name, [])], command=command)
            got[name], got[f"{name}_log"] = losses(log), log
            got[f"{name}_eval"] = eval_losses(log)
            got[f"{name}_grad_norm"] = grad_norms(log)
        for name in ("1f1b", "dualpipev", "dualpipe"):
            log = run(f"{name}_p2dp2", out, 4, [*start, *P2DP2, "--pipeline-schedule", name,
                                                *OPTIMIZED.get(name, [])])
            got[f"{name}_p2dp2"], got[f"{name}_p2dp2_log"] = losses(log), log
        for name in ("dualpipev", "dualpipe"):  # the legacy route: a model_provider, training.get_model
            log = run(f"legacy_{name}_p2dp2", out, 4, [*start, *P2DP2, "--pipeline-schedule", name],
                      script=LEGACY_SCRIPT)
            got[f"legacy_{name}_p2dp2"] = losses(log)
        resume = [*TRAIN, *ITERS, "--no-load-rng"]
        for name, ckpt, args in (("v_p4_to_1f1b_p2dp2", "dualpipev_p4",
                                  ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"]),):
            log = run(name, out, 4, [*resume, "--load", str(out / ckpt), "--ckpt-step", "4", *args])
            got[name], got[f"{name}_grad_norm"] = losses(log), grad_norms(log)
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _same(ref: dict[int, float], got: dict[int, float], iterations: range) -> None:
    assert [i for i in iterations if i not in got] == [], f"missing iterations; got {sorted(got)}"
    for i in iterations:
        assert got[i] == pytest.approx(ref[i], rel=RTOL), f"iteration {i}: {got[i]} vs {ref[i]}"


def test_losses_fall_and_are_logged(jobs: dict) -> None:
    assert sorted(jobs["1f1b_p4"]) == list(range(2, 8))
    assert jobs["1f1b_p4"][7] < jobs["1f1b_p4"][2]


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_p4_matches_1f1b(jobs: dict, schedule: str) -> None:
    _same(jobs["1f1b_p4"], jobs[f"{schedule}_p4"], range(2, 8))


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_p2_dp2_distributed_optimizer_overlap_matches_1f1b(jobs: dict, schedule: str) -> None:
    _same(jobs["1f1b_p2dp2"], jobs[f"{schedule}_p2dp2"], range(2, 8))


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_legacy_model_provider_route_matches_1f1b(jobs: dict, schedule: str) -> None:
    """tests/legacy_pretrain_gpt.py passes a model_provider (training.get_model builds the chunks,
    prepared after wrapping); scripts/pretrain_gpt.py's 1F1B built through the config container."""
    _same(jobs["1f1b_p2dp2"], jobs[f"legacy_{schedule}_p2dp2"], range(2, 8))


def test_optimized_order_ran(jobs: dict) -> None:
    found = OPTIMIZED_LINE.findall(jobs["dualpipev_p2dp2_log"])
    assert len(found) == 1 and float(found[0][1]) < float(found[0][0]), found
    assert "op order optimized" not in jobs["dualpipe_p2dp2_log"]


def test_the_schedule_files_budgeted_order_ran(jobs: dict) -> None:
    """Every training step ran the file's order (the trace's executed ops), which keeps every rank
    within the budget that DeepSeek's order exceeds."""
    order = read_schedule_file(jobs["order_file"])
    deepseek = build_schedule("dualpipev", 4, 16)
    assert max(peak_live_activations(ops) for ops in deepseek.ops) > BUDGET
    assert max(peak_live_activations(ops) for ops in order.ops) <= BUDGET
    (pipeline,) = pipelines(load(jobs["dualpipev_p4_trace"]))
    training = [i for i, step in enumerate(pipeline[0].steps) if not step.forward_only]
    assert len(training) == 6, f"{len(training)} training steps traced"
    for index in training:
        assert step_schedule(pipeline, index).ops == order.ops, f"traced step {index} ran another order"


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_evaluation_matches_1f1b(jobs: dict, schedule: str) -> None:
    ref, got = jobs["1f1b_p4_eval"], jobs[f"{schedule}_p4_eval"]
    assert sorted(ref) == ["3", "6", "7 on test set", "7 on validation set"], ref
    assert got == pytest.approx(ref, rel=RTOL)


def test_checkpoint_moves_between_schedules_and_pipeline_sizes(jobs: dict) -> None:
    """A DualPipeV P=4 checkpoint resumed under 1F1B at P=2 x DP=2 logs the uninterrupted run's
    losses and grad norms.

    Megatron's first log after a resume is followed by one that averages two iterations (the
    same with 1F1B -> 1F1B: iteration 6 reports the mean of iterations 5 and 6)."""
    resumed, full = jobs["v_p4_to_1f1b_p2dp2"], jobs["1f1b_p4"]
    want = {5: full[5], 6: (full[5] + full[6]) / 2, 7: full[7]}
    _same(want, resumed, range(5, 8))
    _same(jobs["1f1b_p4_grad_norm"], jobs["v_p4_to_1f1b_p2dp2_grad_norm"], range(5, 8))

