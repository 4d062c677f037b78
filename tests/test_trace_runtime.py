"""``OpTracer`` on the runtime ``Pipeline``: 2 real gloo processes write traces the tools can read.

One launch (the module fixture) feeds one test per check."""

from __future__ import annotations

import json
from typing import Any

import pytest

import trace_workers
from launcher import spawn
from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.ir import F
from dualpipe_megatron.trace import analyze, chrome_trace, load

pytestmark = pytest.mark.multiprocess

WORLD, MICROBATCHES = 2, 4


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], list[Any]]:
    """Each rank's result and the traces the ranks wrote."""
    out = tmp_path_factory.mktemp("trace_runtime")
    results = spawn(WORLD, trace_workers.traced_steps, str(out), MICROBATCHES, timeout=120)
    return results, load(out)


def test_first_rank_reports_a_loss(traced) -> None:
    results, _ = traced
    assert results[0]["losses"][0] is not None


def test_traces_name_their_pipeline_ranks(traced) -> None:
    _, traces = traced
    assert [t.pipeline_rank for t in traces] == [0, 1] and all(t.pipeline == (0, 1) for t in traces)


def test_steps_record_the_schedule_op_order(traced) -> None:
    _, traces = traced
    sched = build_schedule("dualpipev", WORLD, MICROBATCHES)
    for t in traces:
        assert [s.forward_only for s in t.steps] == [False, False, True, False]
        for step in t.steps:
            ops = [o.op for o in step.ops]
            if step.forward_only:
                assert all(isinstance(op, F) for op in ops) and len(ops) == 2 * MICROBATCHES
            else:
                assert ops == sched.ops[t.pipeline_rank]


def test_op_times_are_ordered_within_steps(traced) -> None:
    _, traces = traced
    for t in traces:
        for step in t.steps:
            for o in step.ops:
                assert step.begin <= o.begin <= o.start <= o.end <= step.end and o.wait >= 0
            assert all(a.end <= b.begin for a, b in zip(step.ops, step.ops[1:]))


def test_second_rank_waits_for_the_first_activation(traced) -> None:
    """Rank 1 starts with stage 1's forward: it must wait for rank 0's activation first."""
    _, traces = traced
    assert traces[1].steps[1].ops[0].wait > 0


def test_analyze_reads_the_traces(traced) -> None:
    _, traces = traced
    (report,) = analyze(traces, skip=1)
    assert [s.step for s in report.steps] == [1, 3]
    assert all(0 <= b < s.makespan for s in report.steps for b in s.bubble)


def test_chrome_trace_has_one_thread_per_rank(traced) -> None:
    _, traces = traced
    trace = json.loads(json.dumps(chrome_trace(traces)))
    assert {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"} == {(0, 0), (0, 1)}
