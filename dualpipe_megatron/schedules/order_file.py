"""A schedule file run by a training job (``--dualpipe-schedule-file``).

Any schedule JSON that ``dualpipe-schedules dump`` writes (DeepSeek's order, one optimized
offline with or without an activation budget, or a hand-edited one) can replace the order a job
would build. The job knows its own shape (P, M, the schedule's directions, stages and
placement), so the file must have exactly that shape and be a valid schedule: a file made for
another micro-batch count is refused naming the count it was made for, never stretched or cut.
"""

from __future__ import annotations

import json
from pathlib import Path

from .ir import Schedule, ScheduleError
from .validate import validate


def read_schedule_file(path: str | Path) -> Schedule:
    """The schedule in ``path`` (contract JSON; other keys such as ``programs`` are ignored)."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ScheduleError(f"cannot read {path}: {exc}") from None
    if not isinstance(obj, dict):
        raise ScheduleError(f"{path} is not a schedule JSON object")
    return Schedule.from_json_obj(obj)


def shape_mismatches(sched: Schedule, job: Schedule) -> list[str]:
    """How ``sched``'s shape differs from the order ``job`` would run (empty: the same shape)."""
    if sched.microbatches != job.microbatches:
        return [f"it was made for {sched.microbatches} micro-batches per step; this job runs "
                f"{job.microbatches} (dump it again with --microbatches {job.microbatches})"]
    problems = [f"{what} {mine} (this job: {theirs})" for what, mine, theirs in (
        ("pipeline ranks", sched.ranks, job.ranks), ("directions", sched.directions, job.directions),
        ("stages", sched.stages, job.stages)) if mine != theirs]
    if not problems and sched.placement != job.placement:
        problems.append(f"its stages sit on other ranks than {job.name}'s")
    return problems


def order_for_job(path: str | Path, job: Schedule) -> Schedule:
    """The schedule in ``path``, checked to run ``job``'s shape and validated (complete, every
    dependency met, no deadlock); ``ScheduleError`` naming every mismatch otherwise."""
    sched = read_schedule_file(path)
    problems = shape_mismatches(sched, job)
    if problems:
        raise ScheduleError(f"{path} does not fit this job's {job.name} schedule: " + "; ".join(problems))
    validate(sched)
    return sched


__all__ = ["order_for_job", "read_schedule_file", "shape_mismatches"]
