"""The events core: what each op kind needs and produces, and the one timer of op lists.

An *event* is the completion of a single op: ``("F", key)``, ``("B", key)`` or ``("W", key)``.
:data:`KINDS` is the one table of op kinds; the validator, the simulator, the optimizer, the
layout search and the runtime's message order all read it (``docs/schedules.md``, "Adding an
op kind", lists what else an op kind touches). API:

- :func:`kind` (a single op's row), :func:`needs`, :func:`op_needs` and :func:`produces`: the
  events a single op (or an FB, as its two halves) waits for and makes.
- :func:`receives` and :func:`sends`: the cross-rank part under a schedule's placement, as
  ``(event, peer rank)``; an event received is the producer's output (F: activations) or its
  input grads (B) sent by the rank that made it.
- :func:`live_change` and :func:`peak_live_activations`: the activations an op makes live when
  it starts and frees when it ends (live from an F's start to its weight grad's end).
- :class:`Encoder` turns ops into :class:`TimedOp` (integer events, a cost index, the p2p
  latency on each cross-rank need); :func:`timing` times per-rank lists of them, event-driven,
  in any number type (Fraction, int, float), and reports a rank that stalls (an invalid
  order); :func:`peak` counts an encoded list's peak.
- :func:`completion_order` orders a complete unit-cost timing's ops into an order they can
  complete in; :class:`Replay` keeps that order with each need resolved to the op that makes
  it, to time one valid schedule under many durations in one pass each (the layout search).
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Any, Iterable, NamedTuple, Optional, Protocol, Sequence

from .ir import B, F, Key, Op, Schedule, W, halves

Event = tuple[str, Key]
Single = F | B | W


@dataclass(frozen=True)
class Kind:
    """One single-op kind: the event it makes, what it waits for, what it does to memory.

    ``needs`` are ``(event kind, stage offset)`` at the same direction and micro-batch; a need
    whose stage falls outside the pipeline (an F at stage 0, a B at the last stage) is dropped.
    """

    event: str
    needs: tuple[tuple[str, int], ...]
    starts: int  # activations it makes live when it starts
    frees: int  # activations it frees when it ends


KINDS: dict[str, Kind] = {
    "F": Kind("F", (("F", -1),), 1, 0),
    "B": Kind("B", (("F", 0), ("B", 1)), 0, 1),  # the full backward: input and weight grads
    "B[w=false]": Kind("B", (("F", 0), ("B", 1)), 0, 0),  # input grads only, the weight grad left to W
    "W": Kind("W", (("B", 0),), 0, 1),
}


def kind(half: Single) -> Kind:
    """The row of ``half``'s kind in :data:`KINDS`."""
    return KINDS[_kind_name(half)]


def _kind_name(half: Single) -> str:
    if isinstance(half, B):
        return "B" if half.w else "B[w=false]"
    return type(half).__name__


def needs(half: Single, stages: int) -> list[Event]:
    """The events a single op waits for (the contract's dependency rules)."""
    k = half.key
    return [(name, Key(k.d, k.s + off, k.m)) for name, off in kind(half).needs if 0 <= k.s + off < stages]


def op_needs(op: Op, stages: int) -> list[Event]:
    """Events an op waits for; an FB's halves run together, so neither may feed the other."""
    return [e for h in halves(op) for e in needs(h, stages)]


def produces(op: Op) -> list[Event]:
    return [(kind(h).event, h.key) for h in halves(op)]


def _feeds(event: Event, stages: int) -> list[tuple[Kind, int]]:
    """The kinds, with their stage, that may wait for ``event`` (:data:`KINDS` read backwards)."""
    name, k = event
    return [(row, k.s - off) for row in KINDS.values() for need, off in row.needs
            if need == name and 0 <= k.s - off < stages]


def receives(sched: Schedule, half: Single) -> list[tuple[Event, int]]:
    """The events ``half`` waits for that another rank makes, as (event, source rank)."""
    here = sched.rank_of(half.key.d, half.key.s)
    found = [(e, sched.rank_of(e[1].d, e[1].s)) for e in needs(half, sched.stages)]
    return [(e, src) for e, src in found if src != here]


def sends(sched: Schedule, half: Single) -> list[tuple[Event, int]]:
    """The event ``half`` makes, with each other rank whose ops may wait for it, as (event, destination)."""
    k = half.key
    here = sched.rank_of(k.d, k.s)
    made = (kind(half).event, k)
    peers = {sched.rank_of(k.d, s) for _, s in _feeds(made, sched.stages)} - {here}
    return [(made, dst) for dst in sorted(peers)]


def live_change(op: Op) -> tuple[int, int]:
    """(activations made live when ``op`` starts, activations freed when it ends)."""
    rows = [kind(h) for h in halves(op)]
    return sum(r.starts for r in rows), sum(r.frees for r in rows)


class _Live(Protocol):
    starts: int
    frees: int


class _Change(NamedTuple):
    starts: int
    frees: int


def peak(ops: Iterable[_Live]) -> int:
    """Peak live activations along one rank's list (the count depends only on op order)."""
    live = top = 0
    for o in ops:
        live += o.starts
        if live > top:
            top = live
        live -= o.frees
    return top


def peak_live_activations(ops: Iterable[Op]) -> int:
    """Peak count of (d,s,m) live on a rank: from its F's start until its weight grad is done."""
    return peak(_Change(*live_change(op)) for op in ops)


class TimedOp(NamedTuple):
    """An op as :func:`timing` sees it: integer events, its duration's index, what it does to memory."""

    cost: int  # index into timing()'s durations
    needs: tuple[tuple[int, Any], ...]  # (event, latency added to it: the p2p latency when cross-rank)
    makes: tuple[int, ...]
    starts: int
    frees: int
    op: Op


class _Template(NamedTuple):
    """One single-op kind at one stage, at micro-batch 0: an event's id grows by the number of
    event slots per micro-batch, so :meth:`Encoder.encode` shifts these ids by the op's m."""

    rank: int
    needs: tuple[tuple[int, int], ...]  # (event id, the rank making it)
    makes: int  # the id of the event it makes
    starts: int
    frees: int


class Encoder:
    """Integer events of one schedule's (direction, stage, micro-batch) and op encoding."""

    def __init__(self, sched: Schedule) -> None:
        self.stages, self.per = sched.stages, sched.microbatches_per_direction
        self.placement = dict(sched.placement)
        for rank, _, op in sched.iter_ops():  # a stage left out of the placement is where its ops run
            for h in halves(op):
                self.placement.setdefault((h.key.d, h.key.s), rank)
        self._slot = {name: i for i, name in enumerate(sorted({row.event for row in KINDS.values()}))}
        self.size = sched.directions * self.stages * self.per * len(self._slot)
        self._templates: dict[tuple[str, int, int], _Template] = {}  # by (kind name, d, s)

    def id(self, event: Event) -> int:
        name, k = event
        return ((k.d * self.stages + k.s) * self.per + k.m) * len(self._slot) + self._slot[name]

    def _template(self, half: Single) -> _Template:
        k = half.key
        key = (_kind_name(half), k.d, k.s)
        got = self._templates.get(key)
        if got is None:
            at0, row = replace(half, key=Key(k.d, k.s, 0)), KINDS[key[0]]
            got = self._templates[key] = _Template(
                self.placement[(k.d, k.s)],
                tuple((self.id(e), self.placement[(e[1].d, e[1].s)]) for e in needs(at0, self.stages)),
                self.id((row.event, at0.key)), row.starts, row.frees)
        return got

    def encode(self, op: Op, cost: int, latency: Any, zero: Any = 0) -> TimedOp:
        """``op`` with ``latency`` on each need made on another rank (``zero`` on the others)."""
        slots = len(self._slot)
        parts = [(self._template(h), h.key.m * slots) for h in halves(op)]
        here = parts[0][0].rank  # an FB's halves share a rank
        need = tuple((ev + shift, latency if src != here else zero)
                     for t, shift in parts for ev, src in t.needs)
        return TimedOp(cost, need, tuple(t.makes + shift for t, shift in parts),
                       sum(t.starts for t, _ in parts), sum(t.frees for t, _ in parts), op)


class Timing(NamedTuple):
    """One timed step. When ``complete`` is False a rank stalled (an invalid order): ``ran[r]``
    ops of rank ``r`` ran and the other figures cover those only."""

    complete: bool
    ran: list[int]
    start: list[list[Any]]  # start of every op, per rank
    finish: list[Any]  # each rank's end
    makespan: Any
    ends: list[Any]  # each event's time (None: not made), for a resumed timing
    timed: int  # ops this call timed (all of them, or those after the resume point)


def timing(lists: Sequence[Sequence[TimedOp]], durations: Sequence[Any], events: int, zero: Any = 0,
           since: Optional[tuple[Timing, int, int]] = None) -> Timing:
    """Time per-rank op lists: an op starts when its rank is free and every event it needs was
    made (plus the latency encoded on that need); it ends ``durations[op.cost]`` later.

    Event-driven: a rank runs until an op waits for an event not yet made, and resumes when it
    is. ``events`` is the number of event ids (:attr:`Encoder.size`); ``zero`` the start time.

    ``since = (old, rank, index)`` resumes a complete timing ``old`` of lists that differ from
    these only on ``rank`` from ``index`` on (same durations, and the changed part makes the
    same events that any op needs): every op that started before the first changed op did
    keeps its time, since nothing it waited for can have changed, and only the rest is run.
    """
    ranks = len(lists)
    waiting: list[Optional[list[int]]] = [None] * events
    if since is None:
        end: list[Any] = [None] * events  # None: not made yet
        cursor = [0] * ranks
        free = [zero] * ranks
        start = [[zero] * len(ops) for ops in lists]
    else:
        old, changed, index = since
        cut = old.start[changed][index] if index < len(old.start[changed]) else old.finish[changed]
        end, cursor, free, start = list(old.ends), [0] * ranks, [zero] * ranks, []
        for q, ops in enumerate(lists):
            at = old.start[q]
            c = index if q == changed else bisect_left(at, cut)
            cursor[q] = c
            if c:
                free[q] = at[c - 1] + durations[ops[c - 1].cost]
            start.append(at[:c] + [zero] * (len(ops) - c))
            for o in ops[c:]:
                for ev in o.makes:
                    end[ev] = None
    begin = sum(cursor)
    todo = [r for r in range(ranks - 1, -1, -1) if cursor[r] < len(lists[r])]
    while todo:
        r = todo.pop()
        ops, i, t, at = lists[r], cursor[r], free[r], start[r]
        n = len(ops)
        while i < n:
            o = ops[i]
            s = t
            for ev, lat in o.needs:
                e = end[ev]
                if e is None:
                    break
                e = e + lat
                if e > s:
                    s = e
            else:
                at[i] = s
                t = s + durations[o.cost]
                for ev in o.makes:
                    end[ev] = t
                    if waiting[ev] is not None:
                        todo.extend(waiting[ev])
                        waiting[ev] = None
                i += 1
                continue
            if waiting[ev] is None:
                waiting[ev] = [r]
            else:
                waiting[ev].append(r)
            break
        cursor[r], free[r] = i, t
    complete = all(cursor[r] == len(ops) for r, ops in enumerate(lists))
    return Timing(complete, cursor, start, free, max(free) if free else zero, end, sum(cursor) - begin)


def completion_order(run: Timing) -> list[tuple[int, int]]:
    """(rank, index) of every op by its start, then rank and index: with every duration positive
    (unit costs), each op starts after all the ops it waits for, so they can complete in this order."""
    if not run.complete:
        raise ValueError(f"a rank stalled: only {run.ran} ops ran")
    return [(rank, index) for _, rank, index in
            sorted((t, rank, index) for rank, starts in enumerate(run.start) for index, t in enumerate(starts))]


class Replay:
    """:func:`timing` of one valid schedule's lists, compiled for timing them again and again.

    The lists are run once at unit costs; their completion order, with each need resolved to
    the position of the op that makes it, lets :meth:`makespan` time new durations in one pass
    with no waiting. It gives :func:`timing`'s makespan exactly (same rules: an op starts when
    its rank is free and its needs, plus their latency, are done).
    """

    def __init__(self, lists: Sequence[Sequence[TimedOp]], events: int) -> None:
        ones = [1] * (1 + max((o.cost for ops in lists for o in ops), default=0))
        self.order = completion_order(timing(lists, ones, events))
        self.ranks = len(lists)
        made: dict[int, int] = {}
        self.steps: list[tuple[int, int, tuple[tuple[int, Any], ...]]] = []  # (rank, cost, (producer, latency))
        for pos, (rank, index) in enumerate(self.order):
            o = lists[rank][index]
            self.steps.append((rank, o.cost, tuple((made[ev], lat) for ev, lat in o.needs)))
            made.update(dict.fromkeys(o.makes, pos))

    def makespan(self, durations: Sequence[Any], zero: Any = 0) -> Any:
        end = [zero] * len(self.steps)
        free = [zero] * self.ranks
        for pos, (rank, cost, deps) in enumerate(self.steps):
            ready = free[rank]
            for dep, lat in deps:
                t = end[dep] + lat
                if t > ready:
                    ready = t
            end[pos] = free[rank] = ready + durations[cost]
        return max(free)


__all__ = ["Encoder", "Event", "KINDS", "Kind", "Replay", "TimedOp", "Timing", "completion_order", "kind",
           "live_change", "needs", "op_needs", "peak", "peak_live_activations", "produces", "receives", "sends",
           "timing"]
