"""Rank processes for tests/test_profiler_ranges.py: pipeline steps with and without a profiler.

Each case runs one training step with no profiler on, then a training step and a
forward-only step under ``torch.profiler.profile``, counting every range the
executor creates (a spy on :mod:`dualpipe_megatron.runtime.profiler_ranges`'s
``record_function``) and reading the op ranges back from the exported chrome trace.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from typing import Any

import torch

import runtime_workers as rw


class CountingRecordFunction:
    """Stands in for ``record_function`` in the profiler_ranges module, counting the ranges made."""

    made = 0

    def __init__(self, real: type) -> None:
        self.real = real

    def __call__(self, name: str) -> Any:
        type(self).made += 1
        return self.real(name)


def trace_ranges(path: str, prefix: str) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of the chrome trace's ranges named ``prefix...``, by start."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    ranges = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
              for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(prefix)]
    return sorted(ranges, key=lambda r: r[1])


def profiled_steps(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    from dualpipe_megatron.runtime import Pipeline, profiler_ranges
    from dualpipe_megatron.schedules import build_schedule

    spy = CountingRecordFunction(profiler_ranges.record_function)
    profiler_ranges.record_function = spy
    results: dict[str, Any] = {}
    for case in cases:
        m = case["microbatches"]
        sched = build_schedule(case["schedule"], world, m)
        layers = rw.build_layers(sched.stages, torch.float64, hooked=case["hook"])
        modules = [layers[s] for s in rw.layers_of(sched, rank)]
        xs, y = rw.batch(m * rw.MICRO_ROWS, torch.float64)
        inputs, labels = rw.rank_share(sched, rank, xs, y)
        pipe = Pipeline(modules, case["schedule"], p2p_shapes=[(rw.MICRO_ROWS, rw.HIDDEN)],
                        p2p_dtype=torch.float64, timeout=30.0)
        kwargs = dict(num_microbatches=m, criterion=rw.SumSquares(y.shape[0]), labels=labels)
        rw.HookedBlock.calls = 0
        CountingRecordFunction.made = 0
        pipe.step(*inputs, **kwargs)
        made_off = CountingRecordFunction.made
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            pipe.step(*inputs, **kwargs)
            with torch.no_grad():
                pipe.step(*inputs, **kwargs)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            ranges = trace_ranges(path, profiler_ranges.PREFIX)
        results[case["id"]] = {
            "made_off": made_off, "made_on": CountingRecordFunction.made - made_off,
            "ranges": ranges, "hook_calls": rw.HookedBlock.calls,
        }
    return results
