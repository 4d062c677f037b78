"""Reading a trace directory back: every rank's steps and ops, on one wall-clock time axis."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..schedules.ir import B, F, FB, Op, Schedule, op_from_json, op_to_json
from .recorder import FORMAT


class TraceError(ValueError):
    """A trace directory that cannot be read or analysed as one run."""


@dataclass(frozen=True)
class OpRecord:
    """One executed op; times in wall-clock ns. ``wait`` of ``[begin, end]`` was spent in receives."""

    index: int  # position in the rank's op list
    op: Op
    begin: int
    end: int
    wait: int

    @property
    def start(self) -> int:
        """When computing began (receives are waited for first)."""
        return self.begin + self.wait

    @property
    def busy(self) -> int:
        return self.end - self.begin - self.wait

    @property
    def kind(self) -> str:
        """F, B, W or FB; a B or FB without its weight grad gets "(input grad)"."""
        if isinstance(self.op, FB):
            return "FB" if self.op.b.w else "FB (input grad)"
        if isinstance(self.op, B):
            return "B" if self.op.w else "B (input grad)"
        return "F" if isinstance(self.op, F) else "W"


@dataclass(frozen=True)
class StepRecord:
    step: int
    forward_only: bool
    shape: dict  # schedule name, ranks, stages, microbatches, directions
    begin: int
    end: int
    ops: list[OpRecord]


@dataclass(frozen=True)
class RankTrace:
    path: Path
    global_rank: int
    world_size: int
    pipeline_rank: int
    pipeline: tuple[int, ...]  # global rank of each pipeline rank
    host: str
    steps: list[StepRecord]


def _step(obj: dict, offset: int) -> StepRecord:
    ops = [OpRecord(o["index"], op_from_json(o), o["begin_ns"] + offset, o["end_ns"] + offset, o["wait_ns"])
           for o in obj["ops"]]
    shape = {k: obj[k] for k in ("schedule", "ranks", "stages", "microbatches", "directions")}
    return StepRecord(obj["step"], obj["forward_only"], shape, obj["begin_ns"] + offset, obj["end_ns"] + offset, ops)


def _header(path: Path) -> dict:
    with path.open() as f:
        line = f.readline()
    try:
        head = json.loads(line)
    except json.JSONDecodeError:
        raise TraceError(f"{path}: not a trace file (no header line)") from None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise TraceError(f"{path}: not a trace file (format {head.get('format') if isinstance(head, dict) else None!r}, "
                         f"expected {FORMAT!r})")
    return head


def read_rank(path: Path, shift_ns: int = 0) -> RankTrace:
    """One rank's file with ``shift_ns`` added to its times; a last line cut short by a crash is dropped."""
    head = _header(path)
    lines = path.read_text().splitlines()
    steps = []
    for number, line in enumerate(lines[1:], start=2):
        try:
            steps.append(_step(json.loads(line), shift_ns))
        except json.JSONDecodeError:
            if number != len(lines):
                raise TraceError(f"{path}:{number}: corrupt step record") from None
    return RankTrace(path, head["global_rank"], head["world_size"], head["pipeline_rank"],
                     tuple(head["pipeline"]), head["host"], steps)


def load(directory: str | os.PathLike[str]) -> list[RankTrace]:
    """Every rank's trace in ``directory``; refuses a directory mixing runs or missing ranks.

    Processes on one host share ``perf_counter``'s monotonic clock, so their
    times are used as recorded; across hosts each file's wall-clock offset
    aligns them (as well as the hosts' clocks agree).
    """
    paths = sorted(Path(directory).glob("rank*.jsonl"))
    if not paths:
        raise TraceError(f"no rank*.jsonl trace files in {os.fspath(directory)}")
    heads = [_header(p) for p in paths]
    worlds = sorted({h["world_size"] for h in heads})
    ranks = sorted(h["global_rank"] for h in heads)
    if len(worlds) != 1 or ranks != list(range(worlds[0])):
        raise TraceError(
            f"{os.fspath(directory)} does not hold exactly one run's traces (global ranks {ranks}, "
            f"world sizes {worlds}); trace each run into a fresh directory")
    several_hosts = len({h["host"] for h in heads}) > 1
    traces = [read_rank(p, h["epoch_offset_ns"] if several_hosts else 0) for p, h in zip(paths, heads)]
    return sorted(traces, key=lambda t: t.global_rank)


def pipelines(traces: list[RankTrace]) -> list[list[RankTrace]]:
    """Traces grouped by pipeline, each in pipeline-rank order (pipelines by their first global rank)."""
    groups: dict[tuple[int, ...], list[RankTrace]] = {}
    for t in traces:
        groups.setdefault(t.pipeline, []).append(t)
    for members, group in groups.items():
        if sorted(t.global_rank for t in group) != sorted(members):
            raise TraceError(f"pipeline of global ranks {list(members)} is missing ranks in the trace")
        group.sort(key=lambda t: t.pipeline_rank)
    return [groups[k] for k in sorted(groups)]


def step_schedule(ranks: list[RankTrace], index: int) -> Schedule:
    """The schedule a training step ran, rebuilt from its pipeline's executed ops (placement from the F's)."""
    steps = [r.steps[index] for r in ranks]
    return Schedule.from_json_obj({**steps[0].shape,
                                   "ops": [[op_to_json(o.op) for o in s.ops] for s in steps]})


__all__ = ["OpRecord", "RankTrace", "StepRecord", "TraceError", "load", "pipelines", "read_rank", "step_schedule"]
