"""Constructive candidates for the op-order search (:mod:`.optimize`): an event-driven list
scheduler that places each rank's ops under a cap on its live activations. A :class:`Rule` is a
priority (which ready op a free rank runs) and an admission (when an F may enter under the cap);
:data:`RULES` and :data:`BUDGET_RULES` name the ones the search tries. A :class:`Reference`
instead follows a given order's op ranks and pairs."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, Sequence

from .events import KINDS, kind
from .ir import B, F, FB, Op, W, halves
from .order_model import INF, OrderModel, Singles

Stage = tuple[int, int]  # (direction, stage)
PairPolicy = Sequence[frozenset[tuple[Stage, Stage]]]  # per rank, the (F stage, B stage) it may pair


class Ready(NamedTuple):
    """A stage's next F or B on a free rank, its inputs in."""

    at: float  # when its inputs are in
    stage: Stage
    m: int  # its micro-batch
    ops: Singles  # its stage's single ops

    @property
    def s(self) -> int:
        """Its stage's place in its direction (0: the first, whose B only its own W waits for)."""
        return self.stage[1]


@dataclass(frozen=True)
class Priority:
    """Which of a free rank's ready ops it runs: by default a ready F and a ready B as one F&B
    pair, the oldest micro-batch first (the deepest stage among equals). Every B leaves its weight
    grad to a W, run when the rank would idle."""

    pair: bool = True  # run a ready F and a ready B as one FB
    fill: float = 0.0  # run a W only if the next known input is at least fill * W away
    by_level: bool = False  # rank F/B by the length of the work still behind them, not micro-batch
    b_first: bool = True  # with no pairing, a ready B goes before a ready F
    leaf_last: bool = False  # a stage 0 B (only its W waits for it) runs only when nothing else is ready
    leaf_pair: bool = False  # a ready F runs paired with a ready stage 0 B (whose output nobody waits for)


# The named priorities. "Wins" counts the searches of the budget grid (research/schedule_budget.py)
# whose best list schedule it built, out of 48 without a budget and 48 at K = ceil(3/4 x peak),
# measured before issue 48's cuts.
PAIRED = Priority()
"""Every ready F with a ready B as one F&B pair. Without a budget it won where pairs save time
(9 of 48), but :data:`PAIRED_FILL` makes up for it there; under a budget, with :data:`RESERVED`."""
PAIRED_FILL = Priority(fill=1.0)
"""As :data:`PAIRED`, but a W runs only in a gap at least a W long, so that it never delays an
input about to arrive: wins without a budget where W's are long (16 of 48, W = F or 0.8 F)."""
B_FIRST = Priority(pair=False)
"""No pairs, a ready B before a ready F: under a budget an unpaired order hands activations back
sooner. The priority under :func:`windowed`, and the usual base of the pairing policies
(:mod:`.pair_policy`), whose list schedule wins at K in 17 of 48."""
DEEPEST_FIRST = Priority(pair=False, by_level=True)
"""No pairs, the B with the most work still behind it first: wins without a budget where stage
costs differ (7 of 48, all with per-stage costs)."""
TAIL_FIRST = Priority(pair=False, by_level=True, b_first=False)
"""No pairs, a ready F before a ready B, each by the work behind it: fills the pipeline fastest;
wins without a budget in 10 of 48, nine of them with uniform costs."""
LEAF_LAST = Priority(pair=False, leaf_last=True)
"""As :data:`B_FIRST`, but a stage-0 B (only its own W waits for it) runs only when nothing
else is ready, so that what other ranks wait for goes first. Under :func:`windowed` it holds
the grid's second-worst case, DualPipeV P=16 M=64 (F&B 0.8 of F+B) at K, to +18.8%
(+19.1% without it)."""
LEAF_PAIR = Priority(pair=False, leaf_pair=True)
"""As :data:`B_FIRST`, but a ready F runs paired with a ready stage-0 B, whose output nobody
else waits for, and no other pair. Under :func:`windowed` it holds the grid's worst case,
DualPipe P=16 M=64 (F&B 0.8 of F+B) at K, to +18.8% (+19.1% without it and :data:`LEAF_LAST`)."""


@dataclass(frozen=True)
class Admission:
    """When an F may start on a rank: where its activation fits under the cap, and beyond that
    (so that a list schedule cannot stall for memory) with ``reserve``, or with ``inflight``."""

    reserve: bool = False  # a micro-batch enters a rank only with room for all its stages there
    # n > 0: a banker's margin (room for the oldest micro-batch's later stages here, and for a
    # direction with nothing live) and at most n/8 of the entry rank's cap micro-batches of a
    # direction in flight
    inflight: int = 0


CAPPED = Admission()
"""An F starts wherever its activation fits: the admission without a budget (the caps are the
input's own peaks); under one it can stall for memory, and then builds nothing."""
RESERVED = Admission(reserve=True)
"""A micro-batch enters a rank only with room for all its stages there, so it never stalls;
following DeepSeek's order (:class:`Reference`) under it wins at K in 3 of 48 (P <= 8)."""


def windowed(n: int) -> Admission:
    """At most n/8 of the entry rank's cap micro-batches of a direction in flight, and a
    banker's margin. Under a budget, ranks that take in forwards while they have room fill
    up before the first backward comes back and then all wait at once; this ends that flood.
    Following DeepSeek's order (:class:`Reference`) under it (n = 6, 7, 8) wins at K most
    often (20 of 48)."""
    return Admission(inflight=n)


@dataclass(frozen=True)
class Rule:
    """One list-scheduling rule: a priority under an admission."""

    priority: Priority
    admission: Admission = CAPPED


# The rules the search tries, and besides them under a budget. Rules whose removal moved the
# grid's means by less than 0.1 point and its worst case by less than 1 point were cut (issue
# 48); LEAF_LAST and LEAF_PAIR are such rules too, kept because each holds a worst case.
RULES = tuple(Rule(p) for p in (PAIRED_FILL, DEEPEST_FIRST, TAIL_FIRST))
BUDGET_RULES = ((Rule(PAIRED, RESERVED),) + tuple(Rule(B_FIRST, windowed(n)) for n in (6, 7, 8))
                + (Rule(LEAF_LAST, windowed(7)), Rule(LEAF_PAIR, windowed(7))))


def _levels(model: OrderModel) -> dict[tuple[str, int, int], float]:
    """Static tail length of F and B at each stage: the work on the path from it to the end."""
    out = {}
    for d, s in model.rank:
        back = sum(model.B_input[(d, x)] for x in range(s + 1))
        out[("B", d, s)] = back
        out[("F", d, s)] = (sum(model.F[(d, x)] for x in range(s, model.stages))
                            + sum(model.B_input[(d, x)] for x in range(model.stages)))
    return out


class Live:
    """What a list schedule holds so far: live activations per rank and direction (with
    ``reserve``, plus the slots a micro-batch's first F on a rank claims for its other stages
    there), per stage, and the F's each rank has still to run per direction."""

    def __init__(self, model: OrderModel) -> None:
        self.held = [[0] * model.directions for _ in range(model.ranks)]
        self.at = dict.fromkeys(model.rank, 0)
        self.f_left = [[0] * model.directions for _ in range(model.ranks)]
        for (d, _), r in model.rank.items():
            self.f_left[r][d] += model.per


class Gate:
    """An :class:`Admission` set up for one model and caps: may an F start now?"""

    def __init__(self, model: OrderModel, caps: list[int], admission: Admission) -> None:
        rank, dirs, P = model.rank, model.directions, model.ranks
        depth = [[0] * dirs for _ in range(P)]  # a rank's stages per direction
        for (d, _), r in rank.items():
            depth[r][d] += 1
        first = {(d, s): min(x for y, x in model.stages_on[rank[(d, s)]] if y == d) == s for d, s in rank}
        self.caps, self.spare = caps, admission.inflight > 0
        # a micro-batch enters only while few enough of its direction are in flight (entered,
        # stage 0's weight grad not done), so that ranks downstream never fill up with forwards
        # whose backwards come late (which starves them all at once)
        self.entry = ({d: max(1, caps[rank[(d, 0)]] * admission.inflight // 8) for d in range(dirs)}
                      if admission.inflight else None)
        # what an F of each stage claims on its rank: one activation, or with reserve the rank's
        # stages of its direction when it is the micro-batch's first there
        self.claim = {(d, s): (depth[rank[(d, s)]][d] if first[(d, s)] else 0) if admission.reserve
                      else KINDS["F"].starts for d, s in rank}
        # with a banker's margin: what the oldest micro-batch may still need here
        self.margin = {(d, s): (depth[rank[(d, s)]][d] - 1 if first[(d, s)] else 0) if self.spare else 0
                       for d, s in rank}
        self.others = [[[(y, depth[r][y]) for y in range(dirs) if y != d] for d in range(dirs)] for r in range(P)]

    def room(self, live: Live, r: int, ds: Stage) -> bool:
        """May an F of stage ``ds`` start on rank r under its cap?"""
        d, s = ds
        need = self.claim[ds] + self.margin[ds]
        if self.spare:  # and room for a direction with nothing live that still has F's to run
            mine_held, mine_left = live.held[r], live.f_left[r]
            for y, n in self.others[r][d]:
                if mine_held[y] == 0 and mine_left[y] > 0:
                    need += n
        if self.entry is not None and s == 0 and live.at[ds] >= self.entry[d]:
            return False
        return sum(live.held[r]) + need <= self.caps[r]


class Picker(Protocol):
    """Which of a free rank's ready ops it runs, and when its inputs are in."""

    pairs: bool  # may it pair any ready F with any ready B (for the list schedule's bound)

    def pick(self, r: int, fs: list[Ready], bs: list[Ready], pending: deque[W], must: bool,
             idle: float) -> tuple[Optional[Op], float]: ...


class RulePicker:
    """A :class:`Priority`'s pick, with a per-rank pairing ``policy`` besides."""

    def __init__(self, model: OrderModel, priority: Priority, policy: Optional[PairPolicy]) -> None:
        self.model, self.priority, self.policy = model, priority, policy
        self.pairs = priority.pair
        level = _levels(model)
        self.f_level = {ds: level[("F",) + ds] for ds in model.rank}
        self.b_level = {ds: level[("B",) + ds] for ds in model.rank}

    def f_key(self, x: Ready) -> tuple:
        return (x.m, -self.f_level[x.stage]) if self.priority.by_level else (x.m, -x.s)

    def b_key(self, x: Ready) -> tuple:
        return (-self.b_level[x.stage], x.m) if self.priority.by_level else (x.m, -x.s)

    def pair(self, f: Ready, b: Ready) -> tuple[Op, float]:
        return self.model.pair(f.stage, f.m, b.stage, b.m, False), max(f.at, b.at)

    def pick(self, r: int, fs: list[Ready], bs: list[Ready], pending: deque[W], must: bool,
             idle: float) -> tuple[Optional[Op], float]:
        """The priority's pick among rank r's ready ops; with none, a deferred W if the rank ``must``
        run one (blocked for memory, or done with F and B) or is ``idle`` long enough before its
        next input."""
        rule = self.priority
        if rule.leaf_last and bs and (fs or len(bs) > 1):
            inner = [x for x in bs if x.s > 0]
            if inner or fs:
                bs = inner
        f = (fs[0] if len(fs) == 1 else min(fs, key=self.f_key)) if fs else None
        if rule.leaf_pair and f:
            leaves = [x for x in bs if x.s == 0]
            if leaves:
                return self.pair(f, min(leaves, key=self.b_key))
        if self.policy and self.policy[r] and fs and bs:
            for x in sorted(fs, key=self.f_key):
                for y in sorted(bs, key=self.b_key):
                    if (x.stage, y.stage) in self.policy[r]:
                        return self.pair(x, y)
        b = (bs[0] if len(bs) == 1 else min(bs, key=self.b_key)) if bs else None
        if f and b and rule.pair:
            return self.pair(f, b)
        if b and (not f or rule.b_first):
            return b.ops.b_input[b.m], b.at
        if f:
            return f.ops.f[f.m], f.at
        if pending:
            k = pending[0].key
            if must or idle >= rule.fill * self.model.W[(k.d, k.s)]:
                return pending.popleft(), 0.0
        return None, 0.0


class Inputs(NamedTuple):
    """Where one stage's inputs come from, and how late they arrive on its rank."""

    stage: Stage
    ops: Singles
    before: Optional[Stage]  # the stage whose F output its F needs
    lat_before: float
    after: Optional[Stage]  # the stage whose B output its B needs
    lat_after: float


class ListScheduler:
    """One list schedule's state: each rank's clock, the ops placed so far and what is live."""

    def __init__(self, model: OrderModel, caps: list[int], gate: Gate, picker: Picker,
                 policy: Optional[PairPolicy], bound: float) -> None:
        P, rank, per = model.ranks, model.rank, model.per
        self.model, self.gate, self.picker = model, gate, picker
        self.f_end: dict[Stage, list[Optional[float]]] = {ds: [None] * per for ds in rank}  # per stage, by m
        self.b_end: dict[Stage, list[Optional[float]]] = {ds: [None] * per for ds in rank}
        self.next_f, self.next_b = dict.fromkeys(rank, 0), dict.fromkeys(rank, 0)
        self.clock, self.wake = [0.0] * P, [0.0] * P
        self.pending: list[deque[W]] = [deque() for _ in range(P)]  # deferred weight grads, oldest first
        self.left = [2 * per * len(model.stages_on[r]) for r in range(P)]  # F's and B's still to run
        self.out: list[list[Op]] = [[] for _ in range(P)]
        self.starts: list[list[float]] = [[] for _ in range(P)]  # summed as order_score sums them
        self.heap = [(0.0, r) for r in range(P)]
        self.live = Live(model)
        self.tables = {ds: model.singles(ds) for ds in rank}
        self.inputs = [[self._inputs(ds, r) for ds in model.stages_on[r]] for r in range(P)]
        # for the bound: the work of each rank's F's and B's still to run (a B's with its weight
        # grad), less what pairing them could save at most
        self.work = [0.0] * P
        for ds in rank:
            self.work[rank[ds]] += per * (model.F[ds] + model.B[ds])
        self.saves = [max([0.0] + [model.pair_saves(f, b) for f, b in model.saving_pairs[r]
                                   if picker.pairs or (f, b) in policy[r]])
                      if picker.pairs or policy else 0.0 for r in range(P)]
        self.slack = bound + 1e-9 * max(1.0, bound)  # float sums of the work are not exact

    def lat(self, src: Stage, r: int) -> float:
        return self.model.c if self.model.rank[src] != r else 0.0

    def _inputs(self, ds: Stage, r: int) -> Inputs:
        d, s = ds
        before, after = (d, s - 1) if s > 0 else None, (d, s + 1) if s + 1 < self.model.stages else None
        return Inputs(ds, self.tables[ds], before, self.lat(before, r) if before else 0.0,
                      after, self.lat(after, r) if after else 0.0)

    def run(self) -> Optional[tuple[tuple[float, float], list[list[Op]]]]:
        """Place every op, a free rank at a time; None as :func:`list_schedule` says."""
        while self.heap:
            now, r = heapq.heappop(self.heap)
            if now != self.wake[r] or (self.left[r] == 0 and not self.pending[r]):
                continue
            fs, bs, soonest, blocked = self._ready(r, now)
            op, at = self.picker.pick(r, fs, bs, self.pending[r], blocked or self.left[r] == 0, soonest - now)
            if op is None:
                self.wake[r] = soonest
                if soonest < INF:
                    heapq.heappush(self.heap, (soonest, r))
                continue
            end = self._place(r, op, at)
            f_now = sum(self.live.f_left[r])  # left counts F's and B's
            if end + self.work[r] - min(f_now, self.left[r] - f_now) * self.saves[r] > self.slack:
                return None
        if any(self.left) or any(self.pending):
            return None  # a rank stalled for memory
        return (max(self.clock), sum(map(sum, self.starts))), self.out

    def _ready(self, r: int, now: float) -> tuple[list[Ready], list[Ready], float, bool]:
        """Rank r's ready F's (that its gate admits) and B's at ``now``, the soonest time another
        op's inputs arrive, and whether an F waits for memory."""
        fs, bs, soonest, blocked = [], [], INF, False
        f_end, b_end, per = self.f_end, self.b_end, self.model.per
        for ds, ops, before, lat_before, after, lat_after in self.inputs[r]:
            m = self.next_f[ds]  # its next F: ready when the stage before made its output
            if m < per:
                at = 0.0 if before is None else f_end[before][m]
                if at is not None:
                    if before is not None:
                        at += lat_before
                    if at > now:
                        soonest = min(soonest, at)
                    elif not self.gate.room(self.live, r, ds):
                        blocked = True
                    else:
                        fs.append(Ready(at, ds, m, ops))
            m = self.next_b[ds]  # its next B: ready after its own F and the stage after's B
            if m < self.next_f[ds]:
                at = f_end[ds][m]
                if after is not None:
                    e = b_end[after][m]
                    at = None if e is None else max(at, e + lat_after)
                if at is not None:
                    if at > now:
                        soonest = min(soonest, at)
                    else:
                        bs.append(Ready(at, ds, m, ops))
        return fs, bs, soonest, blocked

    def _place(self, r: int, op: Op, at: float) -> float:
        """Run ``op`` on rank r as soon as the rank is free and its inputs are in; its end."""
        begin = max(self.clock[r], at)
        self.clock[r] = self.wake[r] = end = begin + self.model.duration(op)
        heapq.heappush(self.heap, (end, r))
        self.out[r].append(op)
        self.starts[r].append(begin)
        for h in halves(op):
            if isinstance(h, F):
                self._forward(r, h, end)
            elif isinstance(h, B):
                self._backward(r, h, end)
            else:
                self._weight_grad(r, h)
        return end

    def _notify(self, consumer: Stage, at: float) -> None:
        """Wake the rank of ``consumer`` at ``at`` if that is sooner than it would wake."""
        r = self.model.rank[consumer]
        if at < self.wake[r]:
            self.wake[r] = max(at, self.clock[r])
            heapq.heappush(self.heap, (self.wake[r], r))

    def _forward(self, r: int, h: F, end: float) -> None:
        k, model, live = h.key, self.model, self.live
        ds, d = (k.d, k.s), k.d
        self.work[r] -= model.F[ds]
        live.at[ds] += KINDS["F"].starts
        live.held[r][d] += self.gate.claim[ds]
        self.next_f[ds] += 1
        live.f_left[r][d] -= 1
        self.left[r] -= 1
        self.f_end[ds][k.m] = end
        self._notify(ds, end)
        if k.s + 1 < model.stages:
            self._notify((d, k.s + 1), end + self.lat(ds, model.rank[(d, k.s + 1)]))

    def _backward(self, r: int, h: B, end: float) -> None:
        k, model, live = h.key, self.model, self.live
        ds, d = (k.d, k.s), k.d
        row = KINDS["B"] if h.w else KINDS["B[w=false]"]
        self.work[r] -= model.B[ds] if h.w else model.B_input[ds]
        live.held[r][d] -= row.frees
        live.at[ds] -= row.frees
        self.next_b[ds] += 1
        self.left[r] -= 1
        self.b_end[ds][k.m] = end
        if k.s > 0:
            self._notify((d, k.s - 1), end + self.lat(ds, model.rank[(d, k.s - 1)]))
        if not h.w:
            self.pending[r].append(self.tables[ds].w[k.m])

    def _weight_grad(self, r: int, h: W) -> None:
        ds, frees = (h.key.d, h.key.s), KINDS["W"].frees
        self.work[r] -= self.model.W[ds]
        self.live.held[r][h.key.d] -= frees
        self.live.at[ds] -= frees


def list_schedule(model: OrderModel, caps: list[int], rule: Rule, follow: Optional["Reference"] = None,
                  bound: float = INF, policy: Optional[PairPolicy] = None
                  ) -> Optional[tuple[tuple[float, float], list[list[Op]]]]:
    """Event-driven list scheduling: micro-batches in order per stage, each rank under its cap;
    with ``follow``, ready ops are ranked by their place in that order (and paired as there);
    with ``policy``, a rank pairs a ready F and a ready B (the first such by the rule's ranks)
    where its policy lists their stages, besides what the rule pairs.
    Returns the order and its :func:`order_score`: each op starts when its rank is free and its
    inputs are in, which are :func:`~.events.timing`'s rules, so the score is the timing's.
    Every rank's peak of live activations stays within its cap, with no check afterwards: an F
    starts only where the rule's admission counts at least the activations live (a reservation,
    more). None if a rank stalls for memory, or once the makespan is sure to exceed ``bound`` (a
    rank's clock plus the least time its ops still to run can take, every possible pair paired)."""
    gate = Gate(model, caps, rule.admission)
    picker: Picker = RulePicker(model, rule.priority, policy) if follow is None else follow.picker(model)
    return ListScheduler(model, caps, gate, picker, policy, bound).run()


class Reference:
    """A given order's place of each op, for :func:`list_schedule` to follow under a cap."""

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

    def picker(self, model: OrderModel) -> "ReferencePicker":
        return ReferencePicker(self, model)


class ReferencePicker:
    """A :class:`Reference`'s pick: the ready op (F, B, W, or an F&B pair as in the reference)
    that comes first there."""

    pairs = True

    def __init__(self, ref: Reference, model: OrderModel) -> None:
        self.ref, self.model = ref, model

    def pick(self, r: int, fs: list[Ready], bs: list[Ready], pending: deque[W], must: bool,
             idle: float) -> tuple[Optional[Op], float]:
        pos, full = self.ref.pos, self.ref.full
        ready = {("F", *x.stage, x.m): x for x in fs}
        ready.update({("B", *x.stage, x.m): x for x in bs})
        if pending:
            k = pending[0].key
            if must or not ready or pos[("W", k.d, k.s, k.m)] < min(pos[x] for x in ready):
                return pending.popleft(), 0.0
        if not ready:
            return None, 0.0
        first = min(ready, key=lambda x: (pos[x], x[0]))
        other = self.ref.partner.get(first)
        if other in ready:
            f, b = (ready[first], ready[other]) if first[0] == "F" else (ready[other], ready[first])
            return self.model.pair(f.stage, f.m, b.stage, b.m, full[(*b.stage, b.m)]), max(f.at, b.at)
        x = ready[first]
        if first[0] == "F":
            return x.ops.f[x.m], x.at
        return x.ops.backward(full[first[1:]])[x.m], x.at
