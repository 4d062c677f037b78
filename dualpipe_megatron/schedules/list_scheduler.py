"""Constructive candidates for the op-order search (:mod:`.optimize`): an event-driven list
scheduler that places each rank's ops under a cap on its live activations, by one of several
priority and admission rules (:class:`Rule`), or following a given order's op ranks and pairs
(:class:`Reference`)."""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional, Sequence

from .events import KINDS, kind
from .ir import B, F, FB, Op, W, halves
from .order_model import INF, OrderModel


@dataclass(frozen=True)
class Rule:
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
    leaf_last: bool = False  # a stage 0 B (only its W waits for it) runs only when nothing else is ready
    leaf_pair: bool = False  # a ready F runs paired with a ready stage 0 B (whose output nobody waits for)


RULES = (
    Rule(), Rule(fill=1.0), Rule(defer=False), Rule(pair=False),
    Rule(pair=False, by_level=True), Rule(pair=False, by_level=True, b_first=False),
)
_DEFERRING_RULES = tuple(r for r in RULES if r.defer)  # the rules that leave weight grads to W's
# Tried only under a budget. Those whose list schedule was never among the six best of a case on
# the 48-case grid are left out (full backwards, and all but one rule with per-direction
# shares or per-stage windows), which leaves every order the grid finds as it was.
BUDGET_RULES = (
    tuple(Rule(**{**vars(r), "reserve": True}) for r in _DEFERRING_RULES)
    + (Rule(fill=1.0, reserve=True, split=True),)
    + tuple(Rule(**{**vars(r), "spare": True}) for r in _DEFERRING_RULES)
    + (Rule(pair=False, by_level=True, b_first=False, spare=True, windows=True),)
    + tuple(Rule(pair=pair, spare=True, inflight=n) for pair in (False, True) for n in (5, 6, 7, 8))
    + (Rule(pair=False, spare=True, inflight=7, leaf_last=True),
       Rule(pair=False, spare=True, inflight=7, leaf_pair=True)))


def _shares(model: OrderModel, caps: list[int], depth: Counter) -> Optional[dict[tuple[int, int], int]]:
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


def _windows(model: OrderModel, caps: list[int]) -> dict[tuple[int, int], int]:
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


def _levels(model: OrderModel) -> dict[tuple[str, int, int], float]:
    """Static tail length of F and B at each stage: the work on the path from it to the end."""
    out = {}
    for d, s in model.rank:
        back = sum(model.B_input[(d, x)] for x in range(s + 1))
        out[("B", d, s)] = back
        out[("F", d, s)] = (sum(model.F[(d, x)] for x in range(s, model.stages))
                            + sum(model.B_input[(d, x)] for x in range(model.stages)))
    return out


Stage = tuple[int, int]
PairPolicy = Sequence[frozenset[tuple[Stage, Stage]]]  # per rank, the (F stage, B stage) it may pair


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
    starts: list[list[float]] = [[] for _ in range(P)]  # summed as order_score sums them (sum() compensates)
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
    saves = [max([0.0] + [model.pair_saves(f, b) for f, b in model.saving_pairs[r] if pairs or (f, b) in policy[r]])
             if pairs or policy else 0.0 for r in range(P)]
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

    def by_rule(r: int, fs: list, bs: list, pending: deque, must: bool, idle: float) -> tuple[Optional[Op], float]:
        """The rule's pick among rank r's ready ops; with none, a deferred W if the rank ``must`` run
        one (blocked for memory, or done with F and B) or is ``idle`` long enough before its next input."""
        if rule.leaf_last and bs and (fs or len(bs) > 1):
            inner = [x for x in bs if x[1][1] > 0]
            if inner or fs:
                bs = inner
        f = (fs[0] if len(fs) == 1 else min(fs, key=f_key)) if fs else None
        if rule.leaf_pair and f:
            leaves = [x for x in bs if x[1][1] == 0]
            if leaves:
                b = min(leaves, key=b_key)
                return model.pair(f[1], f[2], b[1], b[2], not rule.defer), max(f[0], b[0])
        if policy and policy[r] and fs and bs:
            for x in sorted(fs, key=f_key):
                for y in sorted(bs, key=b_key):
                    if (x[1], y[1]) in policy[r]:
                        return model.pair(x[1], x[2], y[1], y[2], not rule.defer), max(x[0], y[0])
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
            op, at = by_rule(r, fs, bs, pending[r], blocked or left[r] == 0, soonest - now)
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

    def pick(self, model: OrderModel, fs: list, bs: list, pending: deque, blocked: bool) -> tuple[Optional[Op], float]:
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
