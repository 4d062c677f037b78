"""A V-Half-like order (Qi et al., "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362).

The paper's V-Half schedule keeps ZB-V's V (rank ``r`` holds stages ``r`` and ``2P-1-r``,
half-size stages) and its B/W split, but repeats its building block at a wider interval so
that a rank holds about half of 1F1B's activations: ``(P+2)//2`` micro-batches of a rank's
share of the model, ``2*((P+2)//2)`` live (d,s,m) half-size stages, against ZB-V's ``2P``.
It pays for the memory with a bubble of about ``P/(2M)`` under F = B(input) = W.

This is not the paper's building-block construction: it is the greedy tick-by-tick pass of
:func:`~.zbv.list_order` (the same priorities as our ZB-V) under the V-Half cap. The cap
alone could deadlock, a rank full of first-stage forwards before its first micro-batch comes
back up the V, so each rank also keeps room for its second stage: rank ``r`` runs a
first-stage F only while it holds fewer than ``cap - min(r+1, cap//2)`` first-stage
activations, the paper's warm-up split (``min(i+1, peak//2)`` second-chunk forwards on
device ``i`` before its first backward).
"""

from __future__ import annotations

from collections import Counter

from .ir import B, F, Op, Schedule, ScheduleError, W
from .zbv import list_order, v_placement, v_priority


def vhalf_cap(ranks: int) -> int:
    """V-Half's peak per rank in (d,s,m) half-size stages: ``(P+2)//2`` micro-batches of two
    stages each, never above ZB-V's ``2P``."""
    return min(2 * ranks, 2 * ((ranks + 2) // 2))


def vhalf(ranks: int, microbatches: int) -> Schedule:
    """V-Half-like: ``P`` ranks, ``2P`` stages in a V, B/W split, at most :func:`vhalf_cap` live per rank."""
    if ranks < 1:
        raise ScheduleError(f"vhalf needs at least 1 rank, got {ranks}")
    if microbatches < 1:
        raise ScheduleError(f"vhalf needs at least 1 micro-batch, got {microbatches}")
    cap = vhalf_cap(ranks)
    shape = Schedule("vhalf", ranks, 2 * ranks, microbatches, 1, [[] for _ in range(ranks)], v_placement(ranks))
    order = v_priority(ranks)

    def pick(rank: int, candidates: list[Op], live: Counter) -> Op | None:
        first = live[0, rank]
        room = sum(live.values()) < cap
        keep = cap - min(rank + 1, cap // 2)  # room kept for the second stage's forwards

        def allowed(op: Op) -> bool:
            if not isinstance(op, F):
                return True
            return room and (op.key.s >= ranks or first < keep)

        candidates = [op for op in candidates if allowed(op)]
        return min(candidates, key=order) if candidates else None

    return list_order(shape, {F: 1, B: 1, W: 1}, True, pick)


__all__ = ["vhalf", "vhalf_cap"]
