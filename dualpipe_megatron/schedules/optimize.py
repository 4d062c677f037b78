"""Op-order optimizer: a schedule no slower and no hungrier than its input, usually faster.

DeepSeek's DualPipe/DualPipeV order is fixed by hand for one cost shape. Given the real
per-stage costs, :func:`optimize_order` searches for a better order within the same
placement and micro-batches. It builds candidates with a memory-capped list scheduler
(several priority rules), then improves the input and the best candidates by an iterated
local search on the critical path (swap, split or pair F&B, defer or move weight grads; when
it stalls, a few seeded random moves and again), spending its work by successive halving over
those starts (the input, and the input with its full backwards split into B(w=false) and W,
among them). It returns the best order that the exact :func:`~.simulate.simulate` confirms to
be no longer than the input, with no rank's peak live activations above that rank's peak in
the input. With an activation budget K (``max_activations``) every rank's cap is K instead,
and the result is the fastest order found within it, slower than the input if the input does
not fit; the list scheduler then also tries admission rules that cannot stall for memory (a
micro-batch enters a rank only with room for all its stages there, or with a banker's margin
for the oldest micro-batch; DualPipe's directions each get a share of the cap; each stage a
window by how long its activations live; a micro-batch enters only while few enough of its
direction are in flight), and orders that follow the input's op ranks and pairs under the
cap. The one-micro-batch-at-a-time order, which meets the minimum (:func:`min_activations`), is
the fallback start. The search is bounded by work, not time, and deterministic; it times
schedules with floats, re-timing only what follows a move (:func:`~.events.timing`'s
``since``), and only the final check is exact. Its pieces (each list schedule, each search,
each exact check) are independent, so :class:`Workers` may run them apart (the pipeline ranks
of a training job do) and the order is the same.
"""

from __future__ import annotations

import heapq
import random
from array import array
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

from .events import KINDS, Encoder, TimedOp, Timing, kind, peak, peak_live_activations, timing
from .ir import B, F, FB, Key, Op, Schedule, ScheduleError, W, halves
from .simulate import AnyCosts, StageCosts, simulate

INF = float("inf")
# The default work bound: local-search evaluations per start scale as this many op-simulations
# (bounded below, and above by _MAX_EVALS per SEARCH_WORK of work).
SEARCH_WORK = 400_000
_MIN_EVALS, _MAX_EVALS = 60, 2000
_BUILT_SEEDS = 6  # list-scheduled orders the local search starts from
_KICK_MOVES = 3  # random moves per kick of the iterated local search


class _Model:
    """Float costs of one schedule's stages and the op encoding the search works on: each op
    encoded once (:class:`~.events.TimedOp`), its float duration at ``durations[op.cost]``."""

    def __init__(self, sched: Schedule, costs: AnyCosts) -> None:
        self.ranks, self.stages, self.directions = sched.ranks, sched.stages, sched.directions
        self.per = sched.microbatches_per_direction
        self.rank = dict(sched.placement)
        self.stages_on = [sched.stages_on(r) for r in range(sched.ranks)]
        self.c = float(costs.c)
        if isinstance(costs, StageCosts):
            costs.check_covers(sched)
        self.costs = costs
        self._by_kind: dict[tuple[int, ...], float] = {}  # durations by kind and stage(s)
        keys = {ds: Key(*ds, 0) for ds in self.rank}
        self.F = {ds: self.duration(F(k)) for ds, k in keys.items()}
        self.B = {ds: self.duration(B(k, True)) for ds, k in keys.items()}  # with its weight grad
        self.B_input = {ds: self.duration(B(k, False)) for ds, k in keys.items()}
        self.W = {ds: self.duration(W(k)) for ds, k in keys.items()}
        self.encoder = Encoder(sched)
        self.durations: list[float] = []
        self._cache: dict[Op, TimedOp] = {}
        self._unpacked: dict[int, Op] = {}
        self._singles_of: dict[tuple[int, int], _Singles] = {}
        self._pairs: dict[tuple[int, int, int, int, int, int, bool], FB] = {}
        self._singles = 4 * self.directions * self.stages * self.per  # codes of single ops (pack)
        self.spent = 0  # ops timed so far: the search's work

    def enc(self, op: Op) -> TimedOp:
        """The op's events and cost, its dependencies by the events core's rules."""
        got = self._cache.get(op)
        if got is None:
            got = self._cache[op] = self.encoder.encode(op, len(self.durations), self.c, 0.0)
            self.durations.append(self.duration(op))
        return got

    def singles(self, ds: tuple[int, int]) -> "_Singles":
        """Stage ``ds``'s single ops by micro-batch (F, B(w=false), B, W), made once and shared,
        so that the list scheduler does not build an op object per op it places."""
        got = self._singles_of.get(ds)
        if got is None:
            keys = [Key(*ds, m) for m in range(self.per)]
            got = self._singles_of[ds] = _Singles([F(k) for k in keys], [B(k, False) for k in keys],
                                                  [B(k, True) for k in keys], [W(k) for k in keys])
        return got

    def pair(self, f: tuple[int, int], fm: int, b: tuple[int, int], bm: int, w: bool) -> FB:
        """The F&B pair of stage ``f``'s F of micro-batch ``fm`` and stage ``b``'s B of ``bm``, made once."""
        key = (*f, fm, *b, bm, w)
        got = self._pairs.get(key)
        if got is None:
            got = self._pairs[key] = FB(self.singles(f).f[fm], self.singles(b).backward(w)[bm])
        return got

    def pack(self, ops: list[list[Op]]) -> "Packed":
        """An order as one array of int64 codes per rank, which workers hand each other far
        faster than op objects: a single op's code is ((kind * D + d) * S + s) * M + m with kind
        its field in :class:`_Singles` (F, B(w=false), B, W); an F&B pair's is N + f * N + b, N
        the number of single codes."""
        n, single = self._singles, self._single
        return [array("q", [n + single(op.f) * n + single(op.b) if isinstance(op, FB) else single(op)
                            for op in row]).tobytes() for row in ops]

    def _single(self, op: Op) -> int:
        k = op.key
        return ((_Singles.field(op) * self.directions + k.d) * self.stages + k.s) * self.per + k.m

    def unpack(self, rows: "Packed") -> list[list[Op]]:
        """The ops of :meth:`pack`'s rows (one shared object per op)."""
        cache, out = self._unpacked, []
        for row in rows:
            ops = []
            for code in array("q", row):
                op = cache.get(code)
                if op is None:
                    op = cache[code] = self._decode(code)
                ops.append(op)
            out.append(ops)
        return out

    def _decode(self, code: int) -> Op:
        n = self._singles
        if code >= n:
            f, b = divmod(code - n, n)
            return FB(self._decode(f), self._decode(b))
        rest, m = divmod(code, self.per)
        rest, s = divmod(rest, self.stages)
        field, d = divmod(rest, self.directions)
        return self.singles((d, s))[field][m]

    def time(self, lists: "Lists", since: Optional[tuple[Timing, int, int]] = None) -> Optional[Timing]:
        """Float timing with simulate()'s rules; None when the order is invalid (a rank stalls).
        ``since``: resume a complete timing of lists that differ only from there on (:func:`timing`)."""
        t = timing(lists, self.durations, self.encoder.size, 0.0, since)
        self.spent += max(1, t.timed)  # always progress, so a search ends
        return t if t.complete else None

    def duration(self, op: Op) -> float:
        """``op``'s duration by the costs' own rule (:meth:`~.simulate.StageCosts.duration`), as a
        float; it depends only on the op's kinds and stages, so it is worked out once for each."""
        if isinstance(op, FB):
            kind_at = (4, op.f.key.d, op.f.key.s, op.b.key.d, op.b.key.s, op.b.w)
        else:
            kind_at = (_Singles.field(op), op.key.d, op.key.s)
        got = self._by_kind.get(kind_at)
        if got is None:
            got = self._by_kind[kind_at] = float(self.costs.duration(op))
        return got

    def pair_saves(self, f: tuple[int, int], b: tuple[int, int]) -> float:
        """What running stage ``f``'s F and stage ``b``'s full B as one F&B pair saves."""
        pair = FB(F(Key(*f, 0)), B(Key(*b, 0), True))
        return self.F[f] + self.B[b] - self.duration(pair)


Lists = list[list[TimedOp]]


class _Singles(NamedTuple):
    """One stage's single ops by micro-batch (:meth:`_Model.singles`); a field's index is its
    kind's code in :meth:`_Model.pack`."""

    f: list[F]
    b_input: list[B]  # B(w=false)
    b_full: list[B]
    w: list[W]

    def backward(self, full: bool) -> list[B]:
        return self.b_full if full else self.b_input

    @staticmethod
    def field(op: F | B | W) -> int:
        """The index of the field that holds ``op``'s kind."""
        return 0 if isinstance(op, F) else 3 if isinstance(op, W) else 2 if op.w else 1


Packed = list[bytes]  # an order as int64 codes, one array per rank (:meth:`_Model.pack`)


def _score(t: Timing) -> tuple[float, float]:
    """Makespan first; the sum of all start times breaks ties, so that near-critical paths shrink too."""
    return t.makespan, sum(map(sum, t.start))


# -- constructive candidates: a memory-capped list scheduler ---------------------------------


@dataclass(frozen=True)
class _Rule:
    """How the list scheduler picks among ready ops on a free rank."""

    pair: bool = True  # run a ready F and a ready B as one FB
    defer: bool = True  # B's leave their weight grad to a W, run when the rank would idle
    fill: float = 0.0  # run a W only if the next known input is at least fill * W away
    by_level: bool = False  # rank F/B by the length of the work still behind them, not micro-batch
    b_first: bool = True  # with no pairing, a ready B goes before a ready F
    reserve: bool = False  # a micro-batch enters a rank only with room for all its stages there
    spare: bool = False  # a banker's margin: room for the oldest micro-batch's later stages and idle directions
    split: bool = False  # each direction gets its own share of a rank's cap (no cross-direction stall)
    windows: bool = False  # each stage gets a share of its rank's cap by how long its activations live
    inflight: int = 0  # n > 0: at most n/8 of the entry rank's cap micro-batches of a direction in flight


_RULES = (
    _Rule(), _Rule(fill=1.0), _Rule(defer=False), _Rule(pair=False),
    _Rule(pair=False, by_level=True), _Rule(pair=False, by_level=True, b_first=False),
)
_DEFERRING_RULES = tuple(r for r in _RULES if r.defer)  # the rules that leave weight grads to W's
# Tried only under a budget. Those whose list schedule was never among the six best of a case on
# the 48-case grid are left out (full backwards, and all but one rule with per-direction
# shares or per-stage windows), which leaves every order the grid finds as it was.
_BUDGET_RULES = (
    tuple(_Rule(**{**vars(r), "reserve": True}) for r in _DEFERRING_RULES)
    + (_Rule(fill=1.0, reserve=True, split=True),)
    + tuple(_Rule(**{**vars(r), "spare": True}) for r in _DEFERRING_RULES)
    + (_Rule(pair=False, by_level=True, b_first=False, spare=True, windows=True),)
    + tuple(_Rule(pair=pair, spare=True, inflight=n) for pair in (False, True) for n in (5, 6, 7, 8)))


def _shares(model: _Model, caps: list[int], depth: Counter) -> Optional[dict[tuple[int, int], int]]:
    """Each (rank, direction)'s share of the rank's cap, in proportion to the micro-batches 1F1B
    keeps in flight at its stages (stages behind them); None if a share would hold less than
    one micro-batch's stages there."""
    weight: Counter = Counter()
    for (d, s), r in model.rank.items():
        weight[(r, d)] += model.stages - s
    out: dict[tuple[int, int], int] = {}
    for r in range(model.ranks):
        mine = sorted((key for key in weight if key[0] == r), key=lambda k: (-weight[k], k))
        total = sum(weight[k] for k in mine)
        for k in mine:
            out[k] = max(depth[k], caps[r] * weight[k] // total)
        spare = caps[r] - sum(out[k] for k in mine)
        if spare < 0:
            return None
        if mine:
            out[mine[0]] += spare
    return out


def _windows(model: _Model, caps: list[int]) -> dict[tuple[int, int], int]:
    """Each stage's share of its rank's cap, in proportion to how long one activation of it
    lives (the forwards after it and the backwards down to it); at least one each."""
    life = {}
    for d, s in model.rank:
        life[(d, s)] = (sum(model.F[(d, x)] for x in range(s + 1, model.stages))
                        + sum(model.B_input[(d, x)] for x in range(s, model.stages)) + model.W[(d, s)])
    out = {}
    for r in range(model.ranks):
        mine = sorted(model.stages_on[r], key=lambda k: (-life[k], k))
        total = sum(life[k] for k in mine)
        for k in mine:
            out[k] = max(1, int(caps[r] * life[k] // total))
        for k in mine[:max(0, caps[r] - sum(out[k] for k in mine))]:
            out[k] += 1
    return out


def _levels(model: _Model) -> dict[tuple[str, int, int], float]:
    """Static tail length of F and B at each stage: the work on the path from it to the end."""
    out = {}
    for d, s in model.rank:
        back = sum(model.B_input[(d, x)] for x in range(s + 1))
        out[("B", d, s)] = back
        out[("F", d, s)] = (sum(model.F[(d, x)] for x in range(s, model.stages))
                            + sum(model.B_input[(d, x)] for x in range(model.stages)))
    return out


def _list_schedule(model: _Model, caps: list[int], rule: _Rule, follow: Optional["_Reference"] = None,
                   bound: float = INF) -> Optional[tuple[tuple[float, float], list[list[Op]]]]:
    """Event-driven list scheduling: micro-batches in order per stage, each rank under its cap;
    with ``follow``, ready ops are ranked by their place in that order (and paired as there).
    Returns the order and its :func:`_score`: each op starts when its rank is free and its
    inputs are in, which are :func:`~.events.timing`'s rules, so the score is the timing's.
    Every rank's peak of live activations stays within its cap, with no check afterwards: an F
    starts only where ``room`` counts at least the activations live (a reservation, more).
    None if a rank stalls for memory, or once the makespan is sure to exceed ``bound`` (a rank's
    clock plus the least time its ops still to run can take, every possible pair paired)."""
    rank, per, stages, c, dirs = model.rank, model.per, model.stages, model.c, model.directions
    level = _levels(model)
    f_level = {ds: level[("F",) + ds] for ds in rank}
    b_level = {ds: level[("B",) + ds] for ds in rank}
    f_end: dict[tuple[int, int], list[Optional[float]]] = {ds: [None] * per for ds in rank}  # per stage, by m
    b_end: dict[tuple[int, int], list[Optional[float]]] = {ds: [None] * per for ds in rank}
    next_f = dict.fromkeys(rank, 0)
    next_b = dict.fromkeys(rank, 0)
    P = model.ranks
    clock, wake = [0.0] * P, [0.0] * P
    pending: list[deque[W]] = [deque() for _ in range(P)]  # deferred weight grads, oldest first
    left = [2 * per * len(model.stages_on[r]) for r in range(P)]
    out: list[list[Op]] = [[] for _ in range(P)]
    starts: list[list[float]] = [[] for _ in range(P)]  # summed as _score sums them (sum() compensates)
    heap = [(0.0, r) for r in range(P)]
    # held: live activations per rank and direction (held[r][d]), plus with reserve the slots
    # that a micro-batch's first F on a rank claims for its other stages there
    depth = [[0] * dirs for _ in range(P)]
    for (d, _), r in rank.items():
        depth[r][d] += 1
    first = {(d, s): min(x for y, x in model.stages_on[rank[(d, s)]] if y == d) == s for d, s in rank}
    held = [[0] * dirs for _ in range(P)]
    f_left = [[0] * dirs for _ in range(P)]  # F's still to run per rank and direction
    for (d, _), r in rank.items():
        f_left[r][d] += per
    share = _shares(model, caps, Counter({(r, d): depth[r][d] for r in range(P) for d in range(dirs)})) \
        if rule.split else None
    if rule.split and share is None:
        return None
    window = _windows(model, caps) if rule.windows else None
    live_at = dict.fromkeys(rank, 0)  # live activations per stage
    # for the bound: the work of each rank's F's and B's still to run (a B's with its weight grad),
    # less what pairing them could save at most
    work = [0.0] * P
    for ds in rank:
        work[rank[ds]] += per * (model.F[ds] + model.B[ds])
    pairs = rule.pair or follow is not None
    saves = [max([0.0] + [model.pair_saves(f, b) for f in model.stages_on[r]
                          for b in model.stages_on[r]]) if pairs else 0.0 for r in range(P)]
    slack = bound + 1e-9 * max(1.0, bound)  # float sums of the work are not exact
    # congestion control: a micro-batch enters only while few enough of its direction are in
    # flight (entered, stage 0's weight grad not done), so that ranks downstream never fill up
    # with forwards whose backwards come late (which starves them all at once)
    entry = ({d: max(1, caps[rank[(d, 0)]] * rule.inflight // 8) for d in range(dirs)}
             if rule.inflight else None)
    f_row, b_row, w_row, bi_row = KINDS["F"], KINDS["B"], KINDS["W"], KINDS["B[w=false]"]
    # what an F of each stage claims on its rank: one activation, or with reserve the rank's
    # stages of its direction when it is the micro-batch's first there
    claim = {(d, s): (depth[rank[(d, s)]][d] if first[(d, s)] else 0) if rule.reserve else f_row.starts
             for d, s in rank}
    # with spare, a banker's margin: what the oldest micro-batch may still need here
    margin = {(d, s): (depth[rank[(d, s)]][d] - 1 if first[(d, s)] else 0) if rule.spare else 0 for d, s in rank}
    others = [[[(y, depth[r][y]) for y in range(dirs) if y != d] for d in range(dirs)] for r in range(P)]

    def room(r: int, d: int, ds: tuple[int, int]) -> bool:
        """May an F of stage ``ds`` (direction d) start on rank r under its cap?"""
        need = claim[ds] + margin[ds]
        if rule.spare:  # and room for a direction with nothing live that still has F's to run
            mine_held, mine_left = held[r], f_left[r]
            for y, n in others[r][d]:
                if mine_held[y] == 0 and mine_left[y] > 0:
                    need += n
        if window is not None and live_at[ds] + 1 > window[ds]:
            return False
        if entry is not None and ds[1] == 0 and live_at[ds] >= entry[d]:
            return False
        if share is not None:
            return held[r][d] + need <= share[(r, d)]
        return sum(held[r]) + need <= caps[r]

    def lat(src: tuple[int, int], r: int) -> float:
        return c if rank[src] != r else 0.0

    # per rank, its stages with where their inputs come from: (stage, d, its single ops, the stage
    # before it and its latency, the stage after it and its latency)
    tables = {ds: model.singles(ds) for ds in rank}
    inputs = [[((d, s), d, tables[(d, s)], (d, s - 1) if s > 0 else None, lat((d, s - 1), r) if s > 0 else 0.0,
                (d, s + 1) if s + 1 < stages else None, lat((d, s + 1), r) if s + 1 < stages else 0.0)
               for d, s in model.stages_on[r]] for r in range(P)]

    def notify(consumer: tuple[int, int], at: float) -> None:
        r = rank[consumer]
        if at < wake[r]:
            wake[r] = max(at, clock[r])
            heapq.heappush(heap, (wake[r], r))

    def by_rule(fs: list, bs: list, pending: deque, must: bool, idle: float) -> tuple[Optional[Op], float]:
        """The rule's pick among the ready ops; with none, a deferred W if the rank ``must`` run one
        (blocked for memory, or done with F and B) or is ``idle`` long enough before its next input."""
        f = (fs[0] if len(fs) == 1 else min(fs, key=f_key)) if fs else None
        b = (bs[0] if len(bs) == 1 else min(bs, key=b_key)) if bs else None
        if f and b and rule.pair:
            return model.pair(f[1], f[2], b[1], b[2], not rule.defer), max(f[0], b[0])
        if b and (not f or rule.b_first):
            return b[3].backward(not rule.defer)[b[2]], b[0]
        if f:
            return f[3].f[f[2]], f[0]
        if pending:
            k = pending[0].key
            if must or idle >= rule.fill * model.W[(k.d, k.s)]:
                return pending.popleft(), 0.0
        return None, 0.0

    def f_key(x: tuple) -> tuple:
        return (x[2], -f_level[x[1]]) if rule.by_level else (x[2], -x[1][1])

    def b_key(x: tuple) -> tuple:
        return (-b_level[x[1]], x[2]) if rule.by_level else (x[2], -x[1][1])

    while heap:
        now, r = heapq.heappop(heap)
        if now != wake[r] or (left[r] == 0 and not pending[r]):
            continue
        fs, bs, soonest, blocked = [], [], INF, False
        for ds, d, ops, before, lat_before, after, lat_after in inputs[r]:
            m = next_f[ds]  # its next F: ready when the stage before made its output
            if m < per:
                at = 0.0 if before is None else f_end[before][m]
                if at is not None:
                    if before is not None:
                        at += lat_before
                    if at > now:
                        soonest = min(soonest, at)
                    elif not room(r, d, ds):
                        blocked = True
                    else:
                        fs.append((at, ds, m, ops))
            m = next_b[ds]  # its next B: ready after its own F and the stage after's B
            if m < next_f[ds]:
                at = f_end[ds][m]
                if after is not None:
                    e = b_end[after][m]
                    at = None if e is None else max(at, e + lat_after)
                if at is not None:
                    if at > now:
                        soonest = min(soonest, at)
                    else:
                        bs.append((at, ds, m, ops))
        if follow is not None:
            op, at = follow.pick(model, fs, bs, pending[r], blocked or left[r] == 0)
        else:
            op, at = by_rule(fs, bs, pending[r], blocked or left[r] == 0, soonest - now)
        if op is None:
            wake[r] = soonest
            if soonest < INF:
                heapq.heappush(heap, (soonest, r))
            continue
        begin = max(clock[r], at)
        clock[r] = wake[r] = end = begin + model.duration(op)
        heapq.heappush(heap, (end, r))
        out[r].append(op)
        starts[r].append(begin)
        for h in halves(op):
            k = h.key
            ds, d = (k.d, k.s), k.d
            if isinstance(h, F):
                work[r] -= model.F[ds]
                live_at[ds] += f_row.starts
                got = claim[ds]
                held[r][d] += got
                next_f[ds] += 1
                f_left[r][d] -= 1
                left[r] -= 1
                f_end[ds][k.m] = end
                notify(ds, end)
                if k.s + 1 < stages:
                    notify((d, k.s + 1), end + lat(ds, rank[(d, k.s + 1)]))
            elif isinstance(h, B):
                row = b_row if h.w else bi_row
                work[r] -= model.B[ds] if h.w else model.B_input[ds]
                held[r][d] -= row.frees
                live_at[ds] -= row.frees
                next_b[ds] += 1
                left[r] -= 1
                b_end[ds][k.m] = end
                if k.s > 0:
                    notify((d, k.s - 1), end + lat(ds, rank[(d, k.s - 1)]))
                if not h.w:
                    pending[r].append(tables[ds].w[k.m])
            else:
                work[r] -= model.W[ds]
                held[r][d] -= w_row.frees
                live_at[ds] -= w_row.frees
        f_now = sum(f_left[r])  # left counts F's and B's
        if end + work[r] - min(f_now, left[r] - f_now) * saves[r] > slack:
            return None
    if any(left) or any(pending):
        return None  # a rank stalled for memory
    return (max(clock), sum(map(sum, starts))), out


class _Reference:
    """A given order's place of each op, for :func:`_list_schedule` to follow under a cap."""

    def __init__(self, ops: list[list[Op]]) -> None:
        # keyed by plain tuples (event, d, s, m), which hash faster than Key
        self.pos: dict[tuple[str, int, int, int], int] = {}
        self.partner: dict[tuple[str, int, int, int], tuple[str, int, int, int]] = {}
        self.full: dict[tuple[int, int, int], bool] = {}
        for rank_ops in ops:
            for i, op in enumerate(rank_ops):
                for h in halves(op):
                    k = h.key
                    self.pos[(kind(h).event, k.d, k.s, k.m)] = i
                    if isinstance(h, B):
                        self.full[(k.d, k.s, k.m)] = h.w
                if isinstance(op, FB):
                    f, b = ("F", op.f.key.d, op.f.key.s, op.f.key.m), ("B", op.b.key.d, op.b.key.s, op.b.key.m)
                    self.partner[f], self.partner[b] = b, f

    def pick(self, model: _Model, fs: list, bs: list, pending: deque, blocked: bool) -> tuple[Optional[Op], float]:
        """The ready op (F, B, W, or an F&B pair as in the reference) that comes first there."""
        pos = self.pos
        ready = {("F", *x[1], x[2]): x for x in fs}
        ready.update({("B", *x[1], x[2]): x for x in bs})
        if pending:
            k = pending[0].key
            if blocked or not ready or pos[("W", k.d, k.s, k.m)] < min(pos[x] for x in ready):
                return pending.popleft(), 0.0
        if not ready:
            return None, 0.0
        first = min(ready, key=lambda x: (pos[x], x[0]))
        other = self.partner.get(first)
        if other in ready:
            f, b = (ready[first], ready[other]) if first[0] == "F" else (ready[other], ready[first])
            return model.pair(f[1], f[2], b[1], b[2], self.full[(*b[1], b[2])]), max(f[0], b[0])
        x = ready[first]
        if first[0] == "F":
            return x[3].f[x[2]], x[0]
        return x[3].backward(self.full[first[1:]])[x[2]], x[0]


# -- local search on the critical path --------------------------------------------------------


def _critical_path(model: _Model, lists: Lists, t: Timing) -> list[tuple[int, int]]:
    """(rank, index) of the ops on one critical path, last op first."""
    where = {ev: (r, i) for r, ops in enumerate(lists) for i, o in enumerate(ops) for ev in o.makes}
    r = max(range(len(lists)), key=lambda x: (t.finish[x], -x))
    i = len(lists[r]) - 1
    path = []
    while i >= 0:
        path.append((r, i))
        begin = t.start[r][i]
        tol = 1e-9 * max(1.0, begin)
        if begin <= tol:
            break
        for ev, lat in lists[r][i].needs:
            pr, pi = where[ev]
            if abs(t.start[pr][pi] + model.durations[lists[pr][pi].cost] + lat - begin) <= tol:
                r, i = pr, pi
                break
        else:
            i -= 1
    return path


def _moves(model: _Model, ops: list[TimedOp], i: int):
    """Changed op lists of one rank that may shorten the critical path through op ``i``, each
    with the first index at which it differs from ``ops``."""
    enc, cur = model.enc, ops[i].op
    if i > 0:
        yield i - 1, ops[:i - 1] + [ops[i], ops[i - 1]] + ops[i + 1:]
        for k in (i - 2, i - 3):
            if k >= 0:  # push an earlier op behind this one
                yield k, ops[:k] + ops[k + 1:i + 1] + [ops[k]] + ops[i + 1:]
    if isinstance(cur, FB):
        for a, b in ((cur.f, cur.b), (cur.b, cur.f)):
            yield i, ops[:i] + [enc(a), enc(b)] + ops[i + 1:]
    back = cur.b if isinstance(cur, FB) else cur
    if isinstance(back, B) and back.w:  # defer its weight grad to a W a little later
        short = B(back.key, False)
        head = ops[:i] + [enc(FB(cur.f, short) if isinstance(cur, FB) else short)]
        rest, w = ops[i + 1:], enc(W(back.key))
        for at in sorted({0, 1, 2, 4, len(rest)}):
            if at <= len(rest):
                yield i, head + rest[:at] + [w] + rest[at:]
    if isinstance(cur, W):
        for j in sorted({i + 2, i + 3, i + 5, len(ops)}):
            if i + 1 < j <= len(ops):
                yield i, ops[:i] + ops[i + 1:j] + [ops[i]] + ops[j:]
        for j in range(i - 1, -1, -1):  # or fold it back into its B
            prev = ops[j].op
            pb = prev.b if isinstance(prev, FB) else prev
            if isinstance(pb, B) and pb.key == cur.key:
                full = B(pb.key, True)
                yield j, ops[:j] + [enc(FB(prev.f, full) if isinstance(prev, FB) else full)] + ops[j + 1:i] + ops[i + 1:]
                break
    for j in (i - 1, i + 1):  # pair it with a neighbour
        if 0 <= j < len(ops):
            lo = min(i, j)
            a, b = ops[lo].op, ops[lo + 1].op
            if isinstance(a, F) and isinstance(b, B):
                yield lo, ops[:lo] + [enc(FB(a, b))] + ops[lo + 2:]
            elif isinstance(a, B) and isinstance(b, F):
                yield lo, ops[:lo] + [enc(FB(b, a))] + ops[lo + 2:]


def _descend(model: _Model, lists: Lists, t: Timing, caps: list[int], until: int) -> tuple[Lists, Timing]:
    """First-improvement descent over :func:`_moves` along the critical path, until the model
    has spent ``until`` op-simulations."""
    best = _score(t)
    improved = True
    while improved and model.spent < until:
        improved = False
        for r, i in _critical_path(model, lists, t):
            for at, changed in _moves(model, lists[r], i):
                if peak(changed) > caps[r]:
                    continue
                old, lists[r] = lists[r], changed
                trial = model.time(lists, (t, r, at))
                if trial is not None and trial.makespan <= best[0] and _score(trial) < best:  # sums only if needed
                    t, best, improved = trial, _score(trial), True
                    break
                lists[r] = old
                if model.spent >= until:
                    return lists, t
            if improved:
                break
    return lists, t


def _kick(model: _Model, lists: Lists, caps: list[int], rng: random.Random, tries: int) -> Lists:
    """A few random valid moves anywhere (not only on the critical path), to leave a local optimum."""
    out = [list(o) for o in lists]
    for _ in range(_KICK_MOVES):
        for _ in range(tries):
            r = rng.randrange(len(out))
            if not out[r]:
                continue
            moves = [m for _, m in _moves(model, out[r], rng.randrange(len(out[r]))) if peak(m) <= caps[r]]
            if not moves:
                continue
            old, out[r] = out[r], rng.choice(moves)
            if model.time(out) is not None:
                break
            out[r] = old
    return out


def _local_search(model: _Model, lists: Lists, caps: list[int], work: int) -> tuple[Lists, Timing]:
    """Iterated local search within ``work`` op-simulations: descend, and while work is left
    kick the best order found and descend again; the random moves come from a fixed seed, so
    the result is deterministic."""
    until = model.spent + work
    t = model.time(lists)
    assert t is not None
    lists, t = _descend(model, lists, t, caps, until)
    best, best_t = [list(o) for o in lists], t
    rng = random.Random(0)
    while model.spent < until:
        trial = _kick(model, best, caps, rng, tries=4)
        tt = model.time(trial)
        if tt is None:
            continue
        trial, tt = _descend(model, trial, tt, caps, until)
        if _score(tt) < _score(best_t):
            best, best_t = [list(o) for o in trial], tt
    return best, best_t


# -- entry point -------------------------------------------------------------------------------


def min_activations(sched: Schedule) -> int:
    """The smallest per-rank budget any valid order of ``sched``'s placement can meet.

    A rank holding k stages of one direction has all k of one micro-batch live when the
    deepest of them starts its F (the shallower ones' weight grads wait for its B), so no
    order goes below the largest such k; the one-micro-batch-at-a-time order
    (:func:`_sequential`) reaches it. DualPipeV's V gives 2, DualPipe and 1F1B 1.
    """
    per_rank: dict[tuple[int, int], int] = {}
    for d, s in sched.placement:
        at = (sched.placement[(d, s)], d)
        per_rank[at] = per_rank.get(at, 0) + 1
    return max(per_rank.values(), default=1)


def _sequential(model: _Model) -> list[list[Op]]:
    """One micro-batch through every stage and back before the next starts: the slowest
    order, and the one that meets :func:`min_activations`."""
    out: list[list[Op]] = [[] for _ in range(model.ranks)]
    for m in range(model.per):
        for d in range(model.directions):
            for s in range(model.stages):
                out[model.rank[(d, s)]].append(F(Key(d, s, m)))
            for s in range(model.stages - 1, -1, -1):
                out[model.rank[(d, s)]].append(B(Key(d, s, m)))
    return out


def _split_weight_grads(ops: list[list[Op]]) -> list[list[Op]]:
    """``ops`` with every full backward (alone or in an F&B pair) split into its input-grad
    part and the weight grad right after it: the same peak, and the B's output leaves a W
    earlier; DeepSeek's steady pairs run full backwards, so this is often faster outright."""
    out: list[list[Op]] = []
    for rank_ops in ops:
        split: list[Op] = []
        for op in rank_ops:
            back = op.b if isinstance(op, FB) else op
            if isinstance(back, B) and back.w:
                short = B(back.key, False)
                split += [FB(op.f, short) if isinstance(op, FB) else short, W(back.key)]
            else:
                split.append(op)
        out.append(split)
    return out


class Workers(Protocol):
    """Where the search's independent pieces run: ``map`` runs ``fn`` on every task (task i on
    worker i % ``count``) and returns every result, in task order, to every caller. A piece's
    result depends only on its task and is plain data (ops, scores), so the order found is the
    same for any count: the pipeline ranks of a training job share the search this way
    (:class:`~dualpipe_megatron.runtime.shared_search.RankWorkers`)."""

    count: int

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]: ...


class SerialWorkers:
    """Every piece here, in task order."""

    count = 1

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]:
        return [fn(task) for task in tasks]


_Built = tuple[tuple[float, float], int, Packed]  # a list schedule: score, candidate index, order


def _keep(best: list[_Built], entry: _Built) -> list[_Built]:
    """``best`` (at most _BUILT_SEEDS distinct orders, by score, then candidate index) offered
    ``entry``: rules often build the same order, and a second search from it would only repeat
    the first."""
    if len(best) == _BUILT_SEEDS and entry[:2] > best[-1][:2]:
        return best
    if any(entry[2] == kept[2] for kept in best):
        return best
    return sorted(best + [entry], key=lambda x: x[:2])[:_BUILT_SEEDS]


def _build(model: _Model, caps: list[int], candidates: list, given: list[list[list[Op]]],
           follow: Sequence[list[list[Op]]], part: list[int], bound: float = INF) -> list[_Built]:
    """The list schedules of ``candidates[i]`` (a rule, and the index of the order in ``follow``
    it follows, or None) for i in ``part``, last first, that complete within the caps and differ
    from the seeds (``given``). Each stops once its makespan is sure to exceed ``bound`` or the
    sixth best of this part's so far; it returns those no longer than the part's sixth best. A
    bound no shorter than the sixth best of all candidates loses none of the best of all, and an
    order longer than six others of its part is not among them, however the candidates are parted."""
    best: list[_Built] = []
    out: list[_Built] = []
    refs: dict[int, _Reference] = {}  # built here, by the worker that follows it
    for i in sorted(part, reverse=True):
        rule, j = candidates[i]
        if j is not None and j not in refs:
            refs[j] = _Reference(follow[j])
        got = _list_schedule(model, caps, rule, None if j is None else refs[j],
                             min(bound, best[-1][0][0] if len(best) == _BUILT_SEEDS else INF))
        if got is None or any(got[1] == order for order in given):
            continue
        out.append((got[0], i, model.pack(got[1])))
        best = _keep(best, out[-1])
    return [entry for entry in out if len(best) < _BUILT_SEEDS or entry[0] <= best[-1][0]]


def _searched(model: _Model, start: Packed, caps: list[int], work: int) -> tuple[tuple[float, float], Packed]:
    """:func:`_local_search` from ``start``, as plain data (its score and order); the start is
    decoded here, by the worker that searches it."""
    lists, t = _local_search(model, [[model.enc(op) for op in ops] for ops in model.unpack(start)], caps, work)
    return _score(t), model.pack([[o.op for o in ops] for ops in lists])


def _best_built(built: list[_Built]) -> list[_Built]:
    """The best distinct list schedules, offered as one part building them all would (last first)."""
    best: list[_Built] = []
    for entry in sorted(built, key=lambda x: -x[1]):
        best = _keep(best, entry)
    return best


def _search(model: _Model, caps: list[int], seeds: list[list[list[Op]]], budget: int, workers: Workers,
            rules: tuple[_Rule, ...] = _RULES, follow: tuple[list[list[Op]], ...] = ()) -> list[tuple[tuple[float, float], Packed]]:
    """Local search from each seed and from the best distinct orders (none equal to a seed) the
    list scheduler builds under ``caps`` by any of ``rules`` (and following each order in
    ``follow``), by successive halving within :func:`_halving_work`: every start gets a short
    search (``budget // 8`` op-simulations), the best half of them twice as long, and so on
    until one is left, which gets the rest: no start is judged by its list-scheduled length
    alone, and the best goes deepest (a descent there is what the work cuts short). Every list
    schedule and every search is one piece for ``workers``; with more than one worker, each
    first builds one list schedule unbounded, and the sixth best of those bounds the rest."""
    admits = {}  # following an order uses a rule's admission test only: one rule per distinct test
    for rule in rules:
        admits.setdefault((rule.reserve, rule.spare, rule.split, rule.windows, rule.inflight), rule)
    candidates = [(rule, None) for rule in rules] + [(rule, j) for j in range(len(follow)) for rule in admits.values()]
    # the last candidates (following an order, windowed entry) are most often the shortest: tried
    # first, they set the bound early
    order = list(range(len(candidates) - 1, -1, -1))
    first = order[:workers.count] if workers.count > 1 else []
    rest = order[len(first):]

    def build(parts: list[list[int]], bound: float) -> list[_Built]:
        return [entry for got in workers.map(lambda part: _build(model, caps, candidates, seeds, follow, part, bound),
                                             parts) for entry in got]

    built = build([[i] for i in first], INF) if first else []
    best = _best_built(built)
    bound = best[-1][0][0] if len(best) == _BUILT_SEEDS else INF
    if rest:
        built += build([rest[w::workers.count] for w in range(workers.count)], bound)
    starts = [model.pack(ops) for ops in seeds] + [kept[2] for kept in _best_built(built)]
    found: list[tuple[tuple[float, float], Packed]] = []
    left, share = _halving_work(len(starts), budget), max(1, budget // 8)
    while starts:
        if len(starts) == 1:
            share = left
        ranked = sorted((score, k, ops) for k, (score, ops) in
                        enumerate(workers.map(lambda start: _searched(model, start, caps, share), starts)))
        left -= share * len(starts)
        found += [(score, ops) for score, _, ops in ranked]
        starts = [ops for _, _, ops in ranked[:len(ranked) // 2]]
        share *= 2
    return found


def _halving_work(starts: int, budget: int) -> int:
    """The whole work of :func:`_search`'s successive halving over ``starts`` starts: what rounds
    of ``budget // 4``, ``budget // 2``, then ``budget`` op-simulations per start would take,
    the better half going on each time. :func:`_search` gives each round's starts half those
    shares and the last start what is left: from six list schedules, 4 x ``budget`` in all,
    of which 2.5 x on the best (with the shares above it would get 1 x)."""
    total, share = 0, max(1, budget // 4)
    while starts:
        total += starts * share
        starts //= 2
        share = min(budget, 2 * share)
    return total


def optimize_order(sched: Schedule, costs: AnyCosts, max_activations: Optional[int] = None,
                   work: int = SEARCH_WORK, workers: Optional[Workers] = None) -> Schedule:
    """A reordering of ``sched`` (same placement and micro-batches); deterministic.

    Without ``max_activations`` it is never slower under ``costs`` and never raises any rank's
    peak live activations. With it, every rank's peak is at most ``max_activations`` (in
    (d,s,m) units, :func:`~.events.peak_live_activations`), and the order is the fastest found
    under that budget: never slower than the input (nor than no budget) when the input fits,
    possibly slower when it does not. A budget below :func:`min_activations` raises.

    ``work`` bounds the search in op-simulations (not seconds, so every rank finds the same
    order); more work finds better orders, slower: ten times the default takes about ten
    times as long. ``workers`` (default: all here) share its independent pieces (list schedules,
    searches, exact checks); the order is the same for any workers.
    """
    if max_activations is not None and max_activations < min_activations(sched):
        raise ScheduleError(
            f"max activations {max_activations} is below the minimum {min_activations(sched)} that any "
            f"order of {sched.name} at P={sched.ranks} needs (live (d,s,m) per rank)")
    workers = SerialWorkers() if workers is None else workers
    model = _Model(sched, costs)
    split_ops = _split_weight_grads(sched.ops)
    n_ops = sum(map(len, sched.ops))
    if work < 1:
        raise ScheduleError(f"search work must be positive, got {work}")
    # op-simulations per start: the work, but at least _MIN_EVALS and at most _MAX_EVALS full
    # timings' worth per SEARCH_WORK of work
    budget = n_ops * max(_MIN_EVALS, min(_MAX_EVALS * work // SEARCH_WORK, work // max(1, n_ops)))
    own = [peak_live_activations(ops) for ops in sched.ops]
    fits = max_activations is None or max(own, default=0) <= max_activations
    # the input's exact step (which validates it): one worker times it, every caller learns it
    step = workers.map(lambda given: simulate(given, costs).makespan, [sched])[0]
    base = step if fits else None  # the bar to beat
    found = _search(model, own, [sched.ops, split_ops], budget, workers) if fits else []
    caps = own if max_activations is None else [max_activations] * sched.ranks
    if caps != own:  # the budget's own search, from the input if it fits, else from the leanest order
        rules = _RULES + tuple(r for r in _BUDGET_RULES if not r.split or sched.directions > 1)
        follow = (sched.ops, split_ops)
        # an input above the budget skips the search under its own peaks: this one gets its work too
        found += _search(model, caps, [sched.ops, split_ops] if fits else [], budget if fits else 2 * budget,
                         workers, rules, follow)
        if not found:
            found = _search(model, caps, [_sequential(model)], budget, workers)
    # the exact check, shortest first, of those shorter than the input when it fits (the first
    # usually fits): one worker each, and every caller learns the answer
    ranked = sorted(((score, i, ops) for i, (score, ops) in enumerate(found)
                     if base is None or score[0] < float(base)), key=lambda x: x[:2])
    for _, _, ops in ranked:
        out = _named(sched, model.unpack(ops))
        if workers.map(lambda new: _fits(new, costs, caps, base), [out])[0]:
            return out
    if not fits:
        raise ScheduleError(f"no order of {sched.name} at P={sched.ranks} found within "
                            f"{max_activations} live activations per rank")
    return _named(sched, [list(ops) for ops in sched.ops])


def _named(sched: Schedule, ops: list[list[Op]]) -> Schedule:
    return Schedule(f"{sched.name}-optimized", sched.ranks, sched.stages, sched.microbatches,
                    sched.directions, ops, dict(sched.placement))


def _fits(new: Schedule, costs: AnyCosts, caps: list[int], makespan) -> bool:
    """The exact check: valid, no rank above its cap, and no longer than ``makespan`` (if given)."""
    result = simulate(new, costs)  # validates
    return (makespan is None or result.makespan <= makespan) and all(
        peak_live_activations(ops) <= cap for ops, cap in zip(new.ops, caps))


__all__ = ["SerialWorkers", "Workers", "min_activations", "optimize_order"]
