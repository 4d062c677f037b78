"""All ranks' traces as one Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev).

One process per pipeline, one thread (track) per pipeline rank; each op is a
complete event (``ph: "X"``) named like ``F m3 s1``, each receive wait a
``p2p wait`` event just before it, and each step a ``step N`` event around its
ops. Times are µs from the earliest recorded step start. The recorder keeps one
wait total per op, so an F&B pair run as F then B shows the B's wait before the
F (busy times stay exact).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..schedules.ir import B, FB, Key, Op, W
from .records import OpRecord, RankTrace, pipelines

NS_PER_US = 1000


def _half_label(kind: str, key: Key) -> str:
    return f"{kind} m{key.m} s{key.s}" + (f" d{key.d}" if key.d else "")


def op_label(op: Op) -> str:
    """``F m3 s1``; ``B``/``W`` alike; an F&B pair as ``F m3 s1 + B m0 s2``; `` d1`` marks direction 1."""
    if isinstance(op, FB):
        return f"{op_label(op.f)} + {op_label(op.b)}"
    kind = "B" if isinstance(op, B) else "W" if isinstance(op, W) else "F"
    return _half_label(kind, op.key)


def _op_args(rec: OpRecord, step: int) -> dict[str, Any]:
    op = rec.op
    keys = {"f": vars(op.f.key), "b": {**vars(op.b.key), "w": op.b.w}} if isinstance(op, FB) \
        else {**vars(op.key), **({"w": op.w} if isinstance(op, B) else {})}
    return {**keys, "step": step, "index": rec.index, "wait_us": rec.wait / NS_PER_US}


def _complete(name: str, cat: str, begin: int, end: int, t0: int, pid: int, tid: int,
              args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": (begin - t0) / NS_PER_US,
            "dur": (end - begin) / NS_PER_US, "pid": pid, "tid": tid, "args": args}


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def chrome_trace(traces: list[RankTrace]) -> dict[str, Any]:
    """The merged trace object (``{"traceEvents": [...], ...}``)."""
    starts = [s.begin for t in traces for s in t.steps]
    t0 = min(starts, default=0)
    events: list[dict[str, Any]] = []
    for pid, ranks in enumerate(pipelines(traces)):
        members = ", ".join(map(str, ranks[0].pipeline))
        events += [_meta("process_name", pid, 0, {"name": f"pipeline {pid} (global ranks {members})"}),
                   _meta("process_sort_index", pid, 0, {"sort_index": pid})]
        for rank in ranks:
            tid = rank.pipeline_rank
            events += [_meta("thread_name", pid, tid,
                             {"name": f"pp rank {tid} (global rank {rank.global_rank}, {rank.host})"}),
                       _meta("thread_sort_index", pid, tid, {"sort_index": tid})]
            for step in rank.steps:
                events.append(_complete(f"step {step.step}", "step", step.begin, step.end, t0, pid, tid,
                                        {"forward_only": step.forward_only, **step.shape}))
                for rec in step.ops:
                    name = op_label(rec.op)
                    if rec.wait:
                        events.append(_complete("p2p wait", "p2p wait", rec.begin, rec.start, t0, pid, tid,
                                                {"before": name, "step": step.step}))
                    events.append(_complete(name, rec.kind, rec.start, rec.end, t0, pid, tid,
                                            _op_args(rec, step.step)))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "dualpipe_megatron.trace"}}


def write_chrome_trace(traces: list[RankTrace], path: str | os.PathLike[str]) -> int:
    """Write the merged trace to ``path``; returns its number of events."""
    trace = chrome_trace(traces)
    Path(path).write_text(json.dumps(trace, separators=(",", ":")))
    return len(trace["traceEvents"])


__all__ = ["chrome_trace", "op_label", "write_chrome_trace"]
