"""Measured activation bytes per executed op, and the simulator's unit count weighed in bytes.

The activation meter (activation_meter.py) records its live bytes after every change on the
clock the op tracer reads, so each op of a traced step gets the bytes live when it began and
ended and the most it held in between (:func:`per_op`). Pure F ops then give what one
micro-batch's forward saves on each stage, pure B(w=false) ops what stays for the weight grads
(:func:`stage_bytes`). :func:`weighted_peak` replays a rank's op list with those bytes in place
of the simulator's one unit per live (d,s,m) (events.py's rule: live from its F's start to its
weight grad's end), to say how much of the gap between "peak units x bytes per unit" and the
measured peak comes from stages weighing differently and how much from B(w=false)'s release.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import NamedTuple

from dualpipe_megatron.schedules.events import kind, peak
from dualpipe_megatron.schedules.ir import B, F, Op, W, halves
from dualpipe_megatron.trace.records import OpRecord

Stage = tuple[int, int]  # (direction, stage)


@dataclass(frozen=True)
class OpBytes:
    """One executed op's activation bytes: live at its begin and end, and the most in between."""

    op: Op
    before: int
    after: int
    top: int


def per_op(timeline: Sequence[tuple[int, int]], ops: Iterable[OpRecord]) -> list[OpBytes]:
    """Each traced op's bytes from the meter's ``(time ns, live bytes)`` timeline (same clock;
    nothing live before the first entry)."""
    times = [t for t, _ in timeline]

    def live_at(t: int) -> int:
        i = bisect_right(times, t)
        return timeline[i - 1][1] if i else 0

    out = []
    for rec in ops:
        before, after = live_at(rec.begin), live_at(rec.end)
        inside = timeline[bisect_right(times, rec.begin):bisect_right(times, rec.end)]
        out.append(OpBytes(rec.op, before, after, max([before, *(v for _, v in inside)])))
    return out


@dataclass(frozen=True)
class StageBytes:
    """One micro-batch on one stage: what its F saves, and what stays after its B(w=false)
    until its W (the weight grads' inputs: layer inputs and output grads). Each is the median
    over the stage's pure ops; ``spread`` is the largest difference from it seen."""

    forward: int
    kept: int
    spread: int

    def to_json_obj(self) -> dict[str, int]:
        return {"forward": self.forward, "kept_after_input_grad": self.kept, "spread": self.spread}


def stage_bytes(ops: Iterable[OpBytes]) -> dict[Stage, StageBytes]:
    """Per stage, from pure F and B(w=false) ops (F&B pairs mix two micro-batches and are skipped);
    a stage without both raises, naming it."""
    saved: dict[Stage, list[int]] = {}
    released: dict[Stage, list[int]] = {}
    for o in ops:
        if isinstance(o.op, F):
            saved.setdefault((o.op.key.d, o.op.key.s), []).append(o.after - o.before)
        elif isinstance(o.op, B) and not o.op.w:
            released.setdefault((o.op.key.d, o.op.key.s), []).append(o.before - o.after)
    missing = sorted(set(saved) ^ set(released))
    if missing:
        raise ValueError(f"stages {missing} ran no pure F or no pure B(w=false): their bytes are not measured")
    out = {}
    for stage in sorted(saved):
        f, r = median(saved[stage]), median(released[stage])
        spread = max(max(abs(x - f) for x in saved[stage]), max(abs(x - r) for x in released[stage]))
        out[stage] = StageBytes(round(f), round(f - r), round(spread))
    return out


class _Change(NamedTuple):
    starts: int
    frees: int


def _half_bytes(half: F | B | W, sb: StageBytes, release_at_input_grad: bool) -> _Change:
    """What ``half`` makes live at its start and frees at its end, in bytes."""
    row = kind(half)
    if release_at_input_grad and isinstance(half, W):
        return _Change(0, sb.kept)
    if release_at_input_grad and isinstance(half, B) and not half.w:
        return _Change(0, sb.forward - sb.kept)
    return _Change(row.starts * sb.forward, row.frees * sb.forward)  # the unit rule, each unit its F's bytes


def weighted_peak(ops: Sequence[Op], stages: Mapping[Stage, StageBytes], release_at_input_grad: bool) -> int:
    """One rank's peak bytes under the unit rule with each (d,s,m) weighing its stage's F bytes;
    with ``release_at_input_grad`` a B(w=false) also drops all but the weight grads' inputs."""
    changes = []
    for op in ops:
        parts = [_half_bytes(h, stages[(h.key.d, h.key.s)], release_at_input_grad) for h in halves(op)]
        changes.append(_Change(sum(p.starts for p in parts), sum(p.frees for p in parts)))
    return peak(changes)
