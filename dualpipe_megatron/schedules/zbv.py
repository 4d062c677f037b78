"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", sail-sg/zero-bubble-pipeline-parallelism).

ZB-V places ``2P`` stages on ``P`` ranks in a V, as DualPipeV does (rank ``r`` holds
stages ``r`` and ``2P-1-r``), splits every backward into B (input grad) and W
(weight grad) and never pairs an F with a B. The op order is not a closed formula
but a greedy pass under the paper's assumption that F, B and W of one stage take
equal time: on every tick each rank runs the first ready op of F on its second
stage, F on its first stage (both only while it holds fewer than ``2P``
half-size stage activations, 1F1B's peak of ``P`` full-size ones), B on its
first stage, B on its second stage, then the oldest W. That gives the paper's
warm-up (``2(P-r)-1`` first-stage forwards on rank ``r``), a steady state of
interleaved F, B and W, and a cool-down that fills the tail with W's; under
``F = B/2 = W`` every rank idles only the unavoidable ``P-1`` stage forwards of
the start-up staircase (checked for P <= 16, 2P <= M <= 4P).
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable

from .ir import B, F, Key, Op, Schedule, ScheduleError, W

# Picks a rank's next op from its ready candidates and its live activations per
# (direction, stage); None leaves the rank idle for this tick.
Picker = Callable[[int, list[Op], Counter], "Op | None"]


def list_order(shape: Schedule, ticks: dict[type, int], split_w: bool, pick: Picker) -> Schedule:
    """Fill ``shape.ops`` by a tick-by-tick greedy run of the whole pipeline.

    Each (direction, stage) runs its forwards and its backwards in micro-batch
    order; ``ticks`` gives each op kind's duration, ``split_w`` makes every B an
    input-grad-only B followed later by its W (oldest first). An op is a
    candidate once its inputs are done; ``pick`` chooses among them.
    """
    per_dir, last = shape.microbatches_per_direction, shape.stages - 1
    held = [shape.stages_on(r) for r in range(shape.ranks)]
    done: dict[tuple[type, int, int, int], int] = {}  # (kind, d, s, m) -> end tick
    next_f: Counter = Counter()
    next_b: Counter = Counter()
    pending: list[deque[Key]] = [deque() for _ in range(shape.ranks)]
    live: list[Counter] = [Counter() for _ in range(shape.ranks)]
    free = [0] * shape.ranks
    left = sum(map(len, held)) * per_dir * (3 if split_w else 2)
    tick = 0

    def ready(kind: type, d: int, s: int, m: int) -> bool:
        return done.get((kind, d, s, m), tick + 1) <= tick

    while left:
        started = False
        for rank, stages in enumerate(held):
            if free[rank] > tick:
                continue
            candidates: list[Op] = []
            for d, s in stages:
                m = next_f[d, s]
                if m < per_dir and (s == 0 or ready(F, d, s - 1, m)):
                    candidates.append(F(Key(d, s, m)))
                m = next_b[d, s]
                if m < per_dir and ready(F, d, s, m) and (s == last or ready(B, d, s + 1, m)):
                    candidates.append(B(Key(d, s, m), w=not split_w))
            if pending[rank]:
                candidates.append(W(pending[rank][0]))
            op = pick(rank, candidates, live[rank])
            if op is None:
                continue
            key = op.key
            if isinstance(op, F):
                next_f[key.d, key.s] += 1
                live[rank][key.d, key.s] += 1
            elif isinstance(op, B):
                next_b[key.d, key.s] += 1
                if op.w:
                    live[rank][key.d, key.s] -= 1
                else:
                    pending[rank].append(key)
            else:
                pending[rank].popleft()
                live[rank][key.d, key.s] -= 1
            shape.ops[rank].append(op)
            done[(type(op), key.d, key.s, key.m)] = free[rank] = tick + ticks[type(op)]
            left -= 1
            started = True
        if not started and all(f <= tick for f in free):
            raise ScheduleError(f"{shape.name}: greedy order stalled at tick {tick} ({left} ops left)")
        tick += 1
    return shape


def v_placement(ranks: int) -> dict[tuple[int, int], int]:
    """The V: ``2P`` stages of one direction, rank ``r`` holding stages ``r`` and ``2P-1-r``."""
    return {(0, s): (s if s < ranks else 2 * ranks - 1 - s) for s in range(2 * ranks)}


def v_priority(ranks: int) -> Callable[[Op], int]:
    """ZB-V's priority among a rank's ready ops: F on the second stage, F on the first, B on the
    first, B on the second, W."""
    def order(op: Op) -> int:
        if isinstance(op, W):
            return 4
        second = op.key.s >= ranks
        return (0 if second else 1) if isinstance(op, F) else (3 if second else 2)
    return order


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZB-V: ``P`` ranks, ``2P`` stages in a V, B/W split, peak ``2P`` stage activations per rank."""
    if ranks < 1:
        raise ScheduleError(f"zbv needs at least 1 rank, got {ranks}")
    if microbatches < 2 * ranks:
        raise ScheduleError(
            f"zbv needs microbatches >= 2*ranks ({2 * ranks}), got {microbatches}: rank 0 warms "
            f"up with 2P-1 forwards before its first backward, as DualPipeV does"
        )
    stages = 2 * ranks
    shape = Schedule("zbv", ranks, stages, microbatches, 1, [[] for _ in range(ranks)], v_placement(ranks))
    order = v_priority(ranks)

    def pick(rank: int, candidates: list[Op], live: Counter) -> Op | None:
        if sum(live.values()) >= stages:  # 2P live stage activations: forwards wait
            candidates = [op for op in candidates if not isinstance(op, F)]
        return min(candidates, key=order) if candidates else None

    return list_order(shape, {F: 1, B: 1, W: 1}, True, pick)
