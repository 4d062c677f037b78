"""Schedule validator: completeness, placement, dependencies and deadlock freedom.

What each op needs and produces is the events core's (:mod:`.events`); :func:`replay`
runs the op lists on its timer at unit costs and returns an order in which the ops
can complete.
"""

from __future__ import annotations

from collections import Counter
from .events import Encoder, Event, completion_order, kind, op_needs, produces, timing
from .ir import B, Key, Schedule, ScheduleError, W, halves


class ValidationError(ScheduleError):
    """A schedule that breaks the contract; the message names the first offending op."""


def _where(sched: Schedule, rank: int, index: int) -> str:
    return f"rank {rank} op #{index} {sched.ops[rank][index]}"


def check_structure(sched: Schedule) -> None:
    """Shape, placement, and exactly-once coverage of every (d, s, m)."""
    if len(sched.ops) != sched.ranks:
        raise ValidationError(f"ops has {len(sched.ops)} rank lists, expected {sched.ranks}")
    if sched.directions < 1 or sched.microbatches % sched.directions:
        raise ValidationError(
            f"microbatches ({sched.microbatches}) must split evenly over "
            f"{sched.directions} direction(s)"
        )
    per_dir = sched.microbatches_per_direction
    owner: dict[tuple[int, int], tuple[int, int]] = {}
    seen: Counter[Event] = Counter()
    w_false: set[Key] = set()
    for rank, index, op in sched.iter_ops():
        for half in halves(op):
            k = half.key
            if not (0 <= k.d < sched.directions and 0 <= k.s < sched.stages and 0 <= k.m < per_dir):
                raise ValidationError(f"{_where(sched, rank, index)}: key out of range")
            ds = (k.d, k.s)
            placed = sched.placement.get(ds)
            if placed is not None and placed != rank:
                raise ValidationError(
                    f"{_where(sched, rank, index)}: stage (d={k.d},s={k.s}) is placed on "
                    f"rank {placed} but this op runs on rank {rank}"
                )
            first = owner.setdefault(ds, (rank, index))
            if first[0] != rank:
                raise ValidationError(
                    f"{_where(sched, rank, index)}: stage (d={k.d},s={k.s}) is on two ranks "
                    f"(also {_where(sched, *first)})"
                )
            event = (kind(half).event, k)
            seen[event] += 1
            if seen[event] > 1:
                raise ValidationError(f"{_where(sched, rank, index)}: duplicate {half}")
            if isinstance(half, B) and not half.w:
                w_false.add(k)
            if isinstance(half, W) and k not in w_false:
                raise ValidationError(
                    f"{_where(sched, rank, index)}: W without an earlier input-grad-only B "
                    f"on this rank (its weight grad would be computed twice or never)"
                )
    for d in range(sched.directions):
        for s in range(sched.stages):
            for m in range(per_dir):
                k = Key(d, s, m)
                for name in ("F", "B"):
                    if not seen[(name, k)]:
                        raise ValidationError(f"missing {name}{k}")
                if k in w_false and not seen[("W", k)]:
                    raise ValidationError(f"missing W{k} for B{k}[w=false]")


def replay(sched: Schedule) -> list[tuple[int, int]]:
    """Run the lists in dependency order; return (rank, index) in an order the ops can
    complete in (by start at unit costs, then rank and index).

    Raises :class:`ValidationError` on a broken dependency (an op waiting for
    something its own rank only does later, or never) or a cross-rank deadlock,
    naming the wait-for cycle.
    """
    stages = sched.stages
    where_made: dict[Event, tuple[int, int]] = {}
    for rank, index, op in sched.iter_ops():
        for event in produces(op):
            where_made[event] = (rank, index)
    for rank, index, op in sched.iter_ops():
        for event in op_needs(op, stages):
            made = where_made.get(event)
            if made is None:
                raise ValidationError(
                    f"{_where(sched, rank, index)} needs {event[0]}{event[1]}, which no rank runs"
                )
            if made[0] == rank and made[1] >= index:
                raise ValidationError(
                    f"{_where(sched, rank, index)} breaks a dependency: it needs "
                    f"{event[0]}{event[1]}, which its rank runs later (op #{made[1]})"
                )

    encoder = Encoder(sched)
    run = timing([[encoder.encode(op, 0, 0) for op in ops] for ops in sched.ops], [1], encoder.size)
    if not run.complete:
        done = {e for rank, ops in enumerate(sched.ops) for op in ops[:run.ran[rank]] for e in produces(op)}
        raise ValidationError(_deadlock_message(sched, run.ran, done, where_made))
    return completion_order(run)


def _deadlock_message(
    sched: Schedule,
    cursor: list[int],
    done: set[Event],
    where_made: dict[Event, tuple[int, int]],
) -> str:
    waits: dict[int, tuple[Event, int]] = {}
    for rank in range(sched.ranks):
        if cursor[rank] < len(sched.ops[rank]):
            op = sched.ops[rank][cursor[rank]]
            missing = next(e for e in op_needs(op, sched.stages) if e not in done)
            waits[rank] = (missing, where_made[missing][0])
    start = min(waits)
    path, rank = [], start
    while rank not in path:
        path.append(rank)
        rank = waits[rank][1]
    cycle = path[path.index(rank):]
    steps = [
        f"rank {r} at {_where(sched, r, cursor[r]).split(' ', 2)[2]} waits for "
        f"{waits[r][0][0]}{waits[r][0][1]} on rank {waits[r][1]}"
        for r in cycle
    ]
    first = cycle[0]
    return (
        f"deadlock at {_where(sched, first, cursor[first])}; wait-for cycle: "
        + "; ".join(steps)
    )


def validate(sched: Schedule) -> list[tuple[int, int]]:
    """Check everything; return the completion order from :func:`replay`."""
    check_structure(sched)
    return replay(sched)
