"""``OpTracer`` on the runtime ``Pipeline``: 2 real gloo processes write traces the tools can read."""

from __future__ import annotations

import json
from pathlib import Path

import runtime_workers as rw
import trace_workers
from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.ir import F
from dualpipe_megatron.trace import analyze, chrome_trace, load


def test_pipeline_steps_are_traced(tmp_path: Path) -> None:
    world, microbatches = 2, 4
    results = rw.launch(world, trace_workers.traced_steps, str(tmp_path), microbatches, timeout=120)
    assert results[0]["losses"][0] is not None
    sched = build_schedule("dualpipev", world, microbatches)
    traces = load(tmp_path)
    assert [t.pipeline_rank for t in traces] == [0, 1] and all(t.pipeline == (0, 1) for t in traces)
    for t in traces:
        assert [s.forward_only for s in t.steps] == [False, False, True, False]
        for step in t.steps:
            ops = [o.op for o in step.ops]
            if step.forward_only:
                assert all(isinstance(op, F) for op in ops) and len(ops) == 2 * microbatches
            else:
                assert ops == sched.ops[t.pipeline_rank]
            for o in step.ops:
                assert step.begin <= o.begin <= o.start <= o.end <= step.end and o.wait >= 0
            assert all(a.end <= b.begin for a, b in zip(step.ops, step.ops[1:]))
    # Rank 1 starts with stage 1's forward: it must wait for rank 0's activation first.
    assert traces[1].steps[1].ops[0].wait > 0
    (report,) = analyze(traces, skip=1)
    assert [s.step for s in report.steps] == [1, 3]
    assert all(0 <= b < s.makespan for s in report.steps for b in s.bubble)
    trace = json.loads(json.dumps(chrome_trace(traces)))
    assert {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"} == {(0, 0), (0, 1)}
