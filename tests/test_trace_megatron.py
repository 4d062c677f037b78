"""``--dualpipe-trace`` through ``megatron.training.pretrain``: every rank writes a trace the tools read."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpipe_megatron.trace import analyze, load
from dualpipe_megatron.trace.cli import main
from launcher import LaunchFailed
from pretrain_runs import TRAIN, losses, run

pytestmark = pytest.mark.multiprocess


def test_pretrain_writes_traces(tmp_path: Path) -> None:
    trace_dir = tmp_path / "trace"
    try:
        log = run("traced", tmp_path, 2, [*TRAIN, "--pipeline-model-parallel-size", "2",
                                          "--pipeline-schedule", "dualpipev", "--train-iters", "3",
                                          "--dualpipe-trace", str(trace_dir)])
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    assert sorted(losses(log)) == [1, 2, 3]
    traces = load(trace_dir)
    assert [t.pipeline_rank for t in traces] == [0, 1]
    assert all(len(t.steps) == 3 and not any(s.forward_only for s in t.steps) for t in traces)
    (report,) = analyze(traces, skip=1)
    assert report.schedule.name == "dualpipev" and report.schedule.microbatches == 16
    assert main(["merge", str(trace_dir)]) == 0 and (trace_dir / "trace.json").exists()
