"""``--dualpipe-schedule-file``: a job runs the order ``dualpipe-schedules dump`` wrote, checked
against the job's shape (P, M, directions, stages, placement) and validated; a file made for
another M is refused naming the M it was made for; the order flags that search in the job are
refused beside it; two ranks given different files raise ``PlanMismatchError`` before the
step's first message. Training from a budgeted file at P=4 against 1F1B: test_megatron_training.py.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import schedule_file_workers as workers
from launcher import spawn
from dualpipe_megatron.megatron import training_hooks
from dualpipe_megatron.megatron.schedule import DualPipeOptions, training_order
from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules import cli as schedules_cli
from dualpipe_megatron.schedules.optimize import optimize_order
from dualpipe_megatron.schedules.simulate import Costs

pytestmark = pytest.mark.multiprocess


def _dump(tmp_path: Path, name: str, *argv: str) -> Path:
    """What ``dualpipe-schedules dump ARGV`` prints, in a file."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert schedules_cli.main(["dump", *argv]) == 0
    path = tmp_path / name
    path.write_text(out.getvalue())
    return path


def _args(path: Path | None, **kw: object) -> SimpleNamespace:
    """The parsed flags post_validate reads for the order (DualPipeV, M=8 unless changed)."""
    base = dict(pipeline_schedule="dualpipev", dualpipe_optimize_order=False, dualpipe_stage_costs=None,
                dualpipe_max_activations=None, dualpipe_schedule_file=None if path is None else str(path),
                global_batch_size=8, micro_batch_size=1, data_parallel_size=1)
    return SimpleNamespace(**{**base, **kw})


def test_the_job_runs_the_dumped_budgeted_order(tmp_path: Path) -> None:
    """``dump --optimize --max-activations 3`` (with its per-rank programs) is the order the job runs."""
    path = _dump(tmp_path, "order.json", "--schedule", "dualpipev", "--ranks", "2", "--microbatches", "8",
                 "--optimize", "--max-activations", "3")
    expected = optimize_order(build_schedule("dualpipev", 2, 8), Costs.of(), max_activations=3)
    ran = training_order(DualPipeOptions(schedule="dualpipev", schedule_file=str(path)), 2, 8)
    assert ran.ops == expected.ops != build_schedule("dualpipev", 2, 8).ops
    assert training_hooks._schedule_file(_args(path), 2) == str(path)


def test_a_file_for_another_microbatch_count_is_refused_naming_it(tmp_path: Path) -> None:
    path = _dump(tmp_path, "m8.json", "--schedule", "dualpipev", "--ranks", "2", "--microbatches", "8")
    with pytest.raises(ValueError, match=r"made for 8 micro-batches per step; this job runs 12"):
        training_order(DualPipeOptions(schedule="dualpipev", schedule_file=str(path)), 2, 12)
    with pytest.raises(ValueError, match=r"made for 8 micro-batches per step; this job runs 16"):
        training_hooks._schedule_file(_args(path, global_batch_size=16), 2)
    # Without a batch size the check waits for the first step (the same check).
    assert training_hooks._schedule_file(_args(path, global_batch_size=None), 2) == str(path)


@pytest.mark.parametrize("argv, why", [
    (["--schedule", "dualpipev", "--ranks", "4", "--microbatches", "8"], r"pipeline ranks 4 \(this job: 2\)"),
    (["--schedule", "dualpipe", "--ranks", "2", "--microbatches", "8"],
     r"directions 2 \(this job: 1\); stages 2 \(this job: 4\)"),
    (["--schedule", "interleaved", "--ranks", "2", "--microbatches", "8", "--chunks", "2"],
     r"its stages sit on other ranks than dualpipev's"),
])
def test_a_file_for_another_shape_is_refused(tmp_path: Path, argv: list[str], why: str) -> None:
    path = _dump(tmp_path, "other.json", *argv)
    with pytest.raises(ValueError, match=rf"^--dualpipe-schedule-file {path} does not fit this job's dualpipev "
                                         rf"schedule: {why}"):
        training_order(DualPipeOptions(schedule="dualpipev", schedule_file=str(path)), 2, 8)


def test_an_invalid_or_unreadable_file_is_refused(tmp_path: Path) -> None:
    obj = json.loads(_dump(tmp_path, "order.json", "--schedule", "dualpipev", "--ranks", "2",
                           "--microbatches", "8", "--no-programs").read_text())
    obj["ops"][1] = obj["ops"][1][:-1]  # rank 1 loses its last op
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=r"^--dualpipe-schedule-file "):
        training_order(DualPipeOptions(schedule="dualpipev", schedule_file=str(broken)), 2, 8)
    with pytest.raises(ValueError, match=r"^--dualpipe-schedule-file cannot read .*missing.json"):
        training_order(DualPipeOptions(schedule="dualpipev", schedule_file=str(tmp_path / "missing.json")), 2, 8)


@pytest.mark.parametrize("flag, value", [("dualpipe_optimize_order", True), ("dualpipe_max_activations", 4),
                                         ("dualpipe_stage_costs", "costs.json")])
def test_the_in_job_search_flags_are_refused_beside_a_file(tmp_path: Path, flag: str, value: object) -> None:
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=rf"^--dualpipe-schedule-file runs the order in its file; drop {name} "):
        training_hooks._schedule_file(_args(tmp_path / "order.json", **{flag: value}), 2)


def test_the_flag_parses() -> None:
    parser = training_hooks.add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--dualpipe-schedule-file", "x.json"]).dualpipe_schedule_file == "x.json"
    assert parser.parse_args([]).dualpipe_schedule_file is None


def test_ranks_given_different_files_fail_before_any_message(tmp_path: Path) -> None:
    """Rank 0 reads DeepSeek's order, rank 1 the optimized one (both valid for the job): both raise
    PlanMismatchError from the step's planning, which precedes its first pipeline message."""
    shape = ["--schedule", "dualpipev", "--ranks", "2", "--microbatches", "8", "--no-programs"]
    paths = [str(_dump(tmp_path, "deepseek.json", *shape)), str(_dump(tmp_path, "optimized.json", *shape,
                                                                          "--optimize"))]
    results = spawn(2, workers.plans_from_files, {"different": paths, "same": [paths[1], paths[1]]}, 8,
                    timeout=120)
    for rank, result in enumerate(results):
        assert result["different"]["ops"] is None, f"rank {rank} planned a step from mismatched files"
        assert "ranks [1] differ from rank 0" in result["different"]["error"], result["different"]["error"]
        assert result["same"]["error"] is None, result["same"]["error"]
