"""Chimera (Li & Hoefler, SC'21): two 1F1B pipelines running in opposite directions.

Rank ``r`` holds stage ``r`` of the down pipeline (direction 0) and stage
``P-1-r`` of the up pipeline (direction 1): two model replicas, as DualPipe.
Each direction gets ``M/2`` micro-batches. The paper's basic unit sends ``P/2``
micro-batches down and ``P/2`` up, so a stage ``s`` never holds more than
``min(P/2, P-s)`` of one direction; larger ``M`` directly concatenates units.
The per-rank order comes from a greedy run under the paper's equal-F-and-B
assumption: backwards first (oldest micro-batch, down before up on a tie),
then forwards within that bound. Backwards stay whole (``w=True``) and no F&B
pairs are formed. With ``F = B`` every rank idles ``P-2`` slots (the paper's
``D-2`` bubbles, half of 1F1B's ``2(D-1)``) for any number of units; with a
longer backward direct concatenation leaves intermediate bubbles (the paper's
forward doubling, which removes them, is not modelled here).
"""

from __future__ import annotations

from collections import Counter

from .ir import B, F, Op, Schedule, ScheduleError
from .zbv import list_order


def chimera(ranks: int, microbatches: int) -> Schedule:
    """Chimera with two pipelines: ``P`` stages per direction, ``M/2`` micro-batches each (``P | M``)."""
    if ranks < 2 or ranks % 2:
        raise ScheduleError(f"chimera needs an even number of ranks >= 2, got {ranks}")
    if microbatches < 1 or microbatches % ranks:
        raise ScheduleError(
            f"chimera needs microbatches a positive multiple of ranks ({ranks}), got {microbatches}: "
            f"it concatenates basic units that each send P/2 micro-batches each way"
        )
    placement = {(0, s): s for s in range(ranks)}
    placement.update({(1, s): ranks - 1 - s for s in range(ranks)})
    shape = Schedule("chimera", ranks, ranks, microbatches, 2, [[] for _ in range(ranks)], placement)
    unit = ranks // 2

    def pick(rank: int, candidates: list[Op], live: Counter) -> Op | None:
        backwards = [op for op in candidates if isinstance(op, B)]
        forwards = [op for op in candidates
                    if isinstance(op, F) and live[op.key.d, op.key.s] < min(unit, ranks - op.key.s)]
        group = backwards or forwards
        return min(group, key=lambda op: (op.key.m, op.key.d)) if group else None

    return list_order(shape, {F: 1, B: 1}, False, pick)
