"""DualPipe and DualPipeV op lists.

Both schedules share one per-rank plan over two *phases* (the two stages a rank
holds). For DualPipeV with ``P`` ranks, rank ``r`` holds stages ``r`` (phase 0)
and ``2P-1-r`` (phase 1) of one direction. DualPipe is two such V's facing each
other: half-rank ``h = min(r, P-1-r)`` plays position ``h`` of a V over ``P/2``
ranks, phase 0 being the direction that enters on its side of the pipeline.

The plan follows the eight steps of the DeepSeek-V3 schedule (warm-up forwards,
F0/F1 interleave, zero-bubble B1-W-F1, the steady overlapped F&B pairs, and the
cool-down whose weight-gradient work fills the tail bubbles), so its bubble and
activation figures match DeepSeek's published op order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from .ir import B, F, FB, Key, Op, Schedule, ScheduleError, W

# A phase-level op: ("F", phase) / ("B", phase, w) / ("W",) / ("FB", f_phase, b_phase)
PhaseOp = tuple


def v_phase_plan(n: int, i: int, m: int, turn: bool) -> list[PhaseOp]:
    """Phase-level op order for position ``i`` of a V over ``n`` ranks and ``m`` micro-batches.

    ``turn`` marks the rank at the bottom of the V, where phase 0 hands over to
    phase 1 locally; its first steady pair runs F and B apart so the hand-off
    is not serialised behind a whole F&B.
    """
    plan: list[PhaseOp] = []
    warm = n - i - 1
    plan += [("F", 0)] * (2 * warm)
    plan += [("F", 0), ("F", 1)] * (i + 1)
    plan += [("B", 1, False), ("W",), ("F", 1)] * warm
    for step in range(m - 2 * n + i + 1):
        if step == 0 and turn:
            plan += [("F", 0), ("B", 1, True)]
        else:
            plan.append(("FB", 0, 1))
        plan.append(("FB", 1, 0))
    plan += [("B", 1, True), ("FB", 1, 0)] * warm
    # Cool-down: the second half of these backwards defers its weight grads.
    deferred = False
    for step in range(i + 1):
        if step == (i + 1) // 2 and i % 2 == 1:
            deferred = True
        plan.append(("B", 1, not deferred))
        if step == (i + 1) // 2 and i % 2 == 0:
            deferred = True
        plan.append(("B", 0, not deferred))
    plan += [("W",), ("B", 0, False)] * warm
    plan += [("W",)] * (i + 1)
    return plan


@dataclass
class _PhaseCursor:
    """Turns phase-level ops into keyed ops for one rank (micro-batches in order, W FIFO)."""

    stage_of_phase: tuple[tuple[int, int], tuple[int, int]]  # phase -> (d, s)

    def __post_init__(self) -> None:
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.pending_w: deque[Key] = deque()

    def _key(self, phase: int, counter: list[int]) -> Key:
        d, s = self.stage_of_phase[phase]
        key = Key(d, s, counter[phase])
        counter[phase] += 1
        return key

    def forward(self, phase: int) -> F:
        return F(self._key(phase, self.next_f))

    def backward(self, phase: int, w: bool) -> B:
        key = self._key(phase, self.next_b)
        if not w:
            self.pending_w.append(key)
        return B(key, w)

    def convert(self, pop: PhaseOp) -> Op:
        kind = pop[0]
        if kind == "F":
            return self.forward(pop[1])
        if kind == "B":
            return self.backward(pop[1], pop[2])
        if kind == "W":
            return W(self.pending_w.popleft())
        return FB(self.forward(pop[1]), self.backward(pop[2], True))


def _build(
    name: str,
    ranks: int,
    microbatches: int,
    directions: int,
    stages: int,
    placement: dict[tuple[int, int], int],
    phases_of: Callable[[int], tuple[tuple[int, int], tuple[int, int]]],
    plan_of: Callable[[int], list[PhaseOp]],
) -> Schedule:
    ops = []
    for rank in range(ranks):
        cursor = _PhaseCursor(phases_of(rank))
        ops.append([cursor.convert(p) for p in plan_of(rank)])
    return Schedule(name, ranks, stages, microbatches, directions, ops, placement)


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV: ``P`` ranks, ``2P`` stages, rank ``r`` holds stages ``r`` and ``2P-1-r``."""
    if ranks < 1:
        raise ScheduleError(f"dualpipev needs at least 1 rank, got {ranks}")
    if microbatches < 2 * ranks:
        raise ScheduleError(
            f"dualpipev needs microbatches >= 2*ranks ({2 * ranks}), got {microbatches}"
        )
    stages = 2 * ranks
    placement = {(0, s): (s if s < ranks else stages - 1 - s) for s in range(stages)}
    return _build(
        "dualpipev", ranks, microbatches, 1, stages, placement,
        phases_of=lambda r: ((0, r), (0, stages - 1 - r)),
        plan_of=lambda r: v_phase_plan(ranks, r, microbatches, turn=r == ranks - 1),
    )


def dualpipe(ranks: int, microbatches: int) -> Schedule:
    """DualPipe: two directions of ``P`` stages; rank ``r`` holds stage ``r`` of
    direction 0 and stage ``P-1-r`` of direction 1. ``M`` counts both directions."""
    if ranks < 2 or ranks % 2:
        raise ScheduleError(f"dualpipe needs an even number of ranks >= 2, got {ranks}")
    if microbatches % 2:
        raise ScheduleError(f"dualpipe needs an even number of microbatches, got {microbatches}")
    if microbatches < 2 * ranks:
        raise ScheduleError(
            f"dualpipe needs microbatches >= 2*ranks ({2 * ranks}), got {microbatches}"
        )
    half = ranks // 2
    placement = {(0, s): s for s in range(ranks)}
    placement.update({(1, s): ranks - 1 - s for s in range(ranks)})

    def phases_of(r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        own = (0, r)  # direction 0 stage on this rank
        mirror = (1, ranks - 1 - r)  # direction 1 stage on this rank
        return (own, mirror) if r < half else (mirror, own)

    def plan_of(r: int) -> list[PhaseOp]:
        h = min(r, ranks - 1 - r)
        return v_phase_plan(half, h, microbatches // 2, turn=h == half - 1)

    return _build("dualpipe", ranks, microbatches, 2, ranks, placement, phases_of, plan_of)
