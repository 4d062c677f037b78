"""Op-order optimizer: a schedule no slower and no hungrier than its input, usually faster.

DeepSeek's DualPipe/DualPipeV order is fixed by hand for one cost shape. Given the real
per-stage costs, :func:`optimize_order` searches for a better order within the same
placement and micro-batches: it builds candidates with a memory-capped list scheduler
(several priority rules), improves them and the input by a local search on the critical
path (swap, split or pair F&B, defer or move weight grads), and returns the best one that
the exact :func:`~.simulate.simulate` confirms to be no longer than the input, with no
rank's peak live activations above that rank's peak in the input. The search times
schedules with floats (much faster than exact fractions); only the final check is exact.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .events import KINDS, Encoder, TimedOp, Timing, live_change, peak, peak_live_activations, timing
from .ir import B, F, FB, Key, Op, Schedule, W, halves
from .simulate import AnyCosts, StageCosts, simulate

INF = float("inf")
# Local-search evaluations per candidate scale as this many op-simulations (bounded below/above).
_SEARCH_WORK = 400_000
_MIN_EVALS, _MAX_EVALS = 60, 2000


class _Model:
    """Float costs of one schedule's stages and the op encoding the search works on: each op
    encoded once (:class:`~.events.TimedOp`), its float duration at ``durations[op.cost]``."""

    def __init__(self, sched: Schedule, costs: AnyCosts) -> None:
        self.ranks, self.stages = sched.ranks, sched.stages
        self.per = sched.microbatches_per_direction
        self.rank = dict(sched.placement)
        self.stages_on = [sched.stages_on(r) for r in range(sched.ranks)]
        self.c = float(costs.c)
        if isinstance(costs, StageCosts):
            costs.check_covers(sched)
            table = {ds: costs.stages[ds] for ds in self.rank}
            ratio = float(costs.fb_ratio)
            fo = {ds: float(v.Fo) for ds, v in table.items()}
            bo = {ds: float(v.Bo) for ds, v in table.items()}
            self.fb = lambda f, b: ratio * (self.F[f] + self.B[b]) - fo[f] - bo[b]
        else:
            table = {ds: costs for ds in self.rank}
            pair = float(costs.FB)
            self.fb = lambda f, b: pair
        self.F = {ds: float(v.F) for ds, v in table.items()}
        self.B = {ds: float(v.B) for ds, v in table.items()}
        self.W = {ds: float(v.W) for ds, v in table.items()}
        self.encoder = Encoder(sched)
        self.durations: list[float] = []
        self._cache: dict[Op, TimedOp] = {}

    def enc(self, op: Op) -> TimedOp:
        """The op's events and cost, its dependencies by the events core's rules."""
        got = self._cache.get(op)
        if got is None:
            got = self._cache[op] = self.encoder.encode(op, len(self.durations), self.c, 0.0)
            self.durations.append(self.duration(op))
        return got

    def time(self, lists: "Lists") -> Optional[Timing]:
        """Float timing with simulate()'s rules; None when the order is invalid (a rank stalls)."""
        t = timing(lists, self.durations, self.encoder.size, 0.0)
        return t if t.complete else None

    def duration(self, op: Op) -> float:
        if isinstance(op, FB):
            b = (op.b.key.d, op.b.key.s)
            return self.fb((op.f.key.d, op.f.key.s), b) - (0.0 if op.b.w else self.W[b])
        ds = (op.key.d, op.key.s)
        if isinstance(op, F):
            return self.F[ds]
        if isinstance(op, B):
            return self.B[ds] - (0.0 if op.w else self.W[ds])
        return self.W[ds]


Lists = list[list[TimedOp]]


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


_RULES = (
    _Rule(), _Rule(fill=1.0), _Rule(defer=False), _Rule(pair=False),
    _Rule(pair=False, by_level=True), _Rule(pair=False, by_level=True, b_first=False),
)


def _levels(model: _Model) -> dict[tuple[str, int, int], float]:
    """Static tail length of F and B at each stage: the work on the path from it to the end."""
    out = {}
    for d, s in model.rank:
        back = sum(model.B[(d, x)] - model.W[(d, x)] for x in range(s + 1))
        out[("B", d, s)] = back
        out[("F", d, s)] = (sum(model.F[(d, x)] for x in range(s, model.stages))
                            + sum(model.B[(d, x)] - model.W[(d, x)] for x in range(model.stages)))
    return out


def _list_schedule(model: _Model, caps: list[int], rule: _Rule) -> Optional[list[list[Op]]]:
    """Event-driven list scheduling: micro-batches in order per stage, each rank under its cap."""
    rank, per, stages, c = model.rank, model.per, model.stages, model.c
    level = _levels(model)
    f_end: dict[tuple[int, int, int], float] = {}
    b_end: dict[tuple[int, int, int], float] = {}
    next_f = dict.fromkeys(rank, 0)
    next_b = dict.fromkeys(rank, 0)
    P = model.ranks
    clock, wake, live = [0.0] * P, [0.0] * P, [0] * P
    pending: list[deque[Key]] = [deque() for _ in range(P)]
    left = [2 * per * len(model.stages_on[r]) for r in range(P)]
    out: list[list[Op]] = [[] for _ in range(P)]
    heap = [(0.0, r) for r in range(P)]

    def lat(src: tuple[int, int], r: int) -> float:
        return c if rank[src] != r else 0.0

    def f_ready(d: int, s: int, m: int, r: int) -> Optional[float]:
        if s == 0:
            return 0.0
        e = f_end.get((d, s - 1, m))
        return None if e is None else e + lat((d, s - 1), r)

    def b_ready(d: int, s: int, m: int, r: int) -> Optional[float]:
        if m >= next_f[(d, s)]:
            return None
        t = f_end[(d, s, m)]
        if s < stages - 1:
            e = b_end.get((d, s + 1, m))
            if e is None:
                return None
            t = max(t, e + lat((d, s + 1), r))
        return t

    def notify(consumer: tuple[int, int], at: float) -> None:
        r = rank[consumer]
        if at < wake[r]:
            wake[r] = max(at, clock[r])
            heapq.heappush(heap, (wake[r], r))

    def f_key(x: tuple[float, tuple[int, int], int]) -> tuple:
        return (x[2], -level[("F",) + x[1]]) if rule.by_level else (x[2], -x[1][1])

    def b_key(x: tuple[float, tuple[int, int], int]) -> tuple:
        return (-level[("B",) + x[1]], x[2]) if rule.by_level else (x[2], -x[1][1])

    while heap:
        now, r = heapq.heappop(heap)
        if now != wake[r] or (left[r] == 0 and not pending[r]):
            continue
        fs, bs, soonest, blocked = [], [], INF, False
        for d, s in model.stages_on[r]:
            for ready, counter, into in ((f_ready, next_f, fs), (b_ready, next_b, bs)):
                m = counter[(d, s)]
                at = ready(d, s, m, r) if m < per else None
                if at is None:
                    continue
                if at > now:
                    soonest = min(soonest, at)
                elif into is fs and live[r] + KINDS["F"].starts > caps[r]:
                    blocked = True
                else:
                    into.append((at, (d, s), m))
        f = min(fs, key=f_key) if fs else None
        b = min(bs, key=b_key) if bs else None
        op: Optional[Op] = None
        at = 0.0
        if f and b and rule.pair:
            op, at = FB(F(Key(*f[1], f[2])), B(Key(*b[1], b[2]), not rule.defer)), max(f[0], b[0])
        elif b and (not f or rule.b_first):
            op, at = B(Key(*b[1], b[2]), not rule.defer), b[0]
        elif f:
            op, at = F(Key(*f[1], f[2])), f[0]
        elif pending[r]:
            k = pending[r][0]
            if blocked or left[r] == 0 or soonest - now >= rule.fill * model.W[(k.d, k.s)]:
                op = W(pending[r].popleft())
        if op is None:
            wake[r] = soonest
            if soonest < INF:
                heapq.heappush(heap, (soonest, r))
            continue
        clock[r] = wake[r] = end = max(clock[r], at) + model.duration(op)
        heapq.heappush(heap, (end, r))
        out[r].append(op)
        starts, frees = live_change(op)
        live[r] += starts - frees
        for h in halves(op):
            k, ds = h.key, (h.key.d, h.key.s)
            if isinstance(h, F):
                next_f[ds] += 1
                left[r] -= 1
                f_end[(k.d, k.s, k.m)] = end
                notify(ds, end)
                if k.s + 1 < stages:
                    notify((k.d, k.s + 1), end + lat(ds, rank[(k.d, k.s + 1)]))
            elif isinstance(h, B):
                next_b[ds] += 1
                left[r] -= 1
                b_end[(k.d, k.s, k.m)] = end
                if k.s > 0:
                    notify((k.d, k.s - 1), end + lat(ds, rank[(k.d, k.s - 1)]))
                if not h.w:
                    pending[r].append(k)
    if any(left) or any(pending):
        return None  # a rank stalled for memory
    return out


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
    """Changed op lists of one rank that may shorten the critical path through op ``i``."""
    enc, cur = model.enc, ops[i].op
    if i > 0:
        yield ops[:i - 1] + [ops[i], ops[i - 1]] + ops[i + 1:]
        for k in (i - 2, i - 3):
            if k >= 0:  # push an earlier op behind this one
                yield ops[:k] + ops[k + 1:i + 1] + [ops[k]] + ops[i + 1:]
    if isinstance(cur, FB):
        for a, b in ((cur.f, cur.b), (cur.b, cur.f)):
            yield ops[:i] + [enc(a), enc(b)] + ops[i + 1:]
    back = cur.b if isinstance(cur, FB) else cur
    if isinstance(back, B) and back.w:  # defer its weight grad to a W a little later
        short = B(back.key, False)
        head = ops[:i] + [enc(FB(cur.f, short) if isinstance(cur, FB) else short)]
        rest, w = ops[i + 1:], enc(W(back.key))
        for at in sorted({0, 1, 2, 4, len(rest)}):
            if at <= len(rest):
                yield head + rest[:at] + [w] + rest[at:]
    if isinstance(cur, W):
        for j in sorted({i + 2, i + 3, i + 5, len(ops)}):
            if i + 1 < j <= len(ops):
                yield ops[:i] + ops[i + 1:j] + [ops[i]] + ops[j:]
        for j in range(i - 1, -1, -1):  # or fold it back into its B
            prev = ops[j].op
            pb = prev.b if isinstance(prev, FB) else prev
            if isinstance(pb, B) and pb.key == cur.key:
                full = B(pb.key, True)
                yield ops[:j] + [enc(FB(prev.f, full) if isinstance(prev, FB) else full)] + ops[j + 1:i] + ops[i + 1:]
                break
    for j in (i - 1, i + 1):  # pair it with a neighbour
        if 0 <= j < len(ops):
            lo = min(i, j)
            a, b = ops[lo].op, ops[lo + 1].op
            if isinstance(a, F) and isinstance(b, B):
                yield ops[:lo] + [enc(FB(a, b))] + ops[lo + 2:]
            elif isinstance(a, B) and isinstance(b, F):
                yield ops[:lo] + [enc(FB(b, a))] + ops[lo + 2:]


def _local_search(model: _Model, lists: Lists, caps: list[int], budget: int) -> tuple[Lists, Timing]:
    """First-improvement descent over :func:`_moves` along the critical path."""
    t = model.time(lists)
    assert t is not None
    best = _score(t)
    evals, improved = 0, True
    while improved and evals < budget:
        improved = False
        for r, i in _critical_path(model, lists, t):
            for changed in _moves(model, lists[r], i):
                if peak(changed) > caps[r]:
                    continue
                evals += 1
                old, lists[r] = lists[r], changed
                trial = model.time(lists)
                if trial is not None and _score(trial) < best:
                    t, best, improved = trial, _score(trial), True
                    break
                lists[r] = old
                if evals >= budget:
                    return lists, t
            if improved:
                break
    return lists, t


# -- entry point -------------------------------------------------------------------------------


def optimize_order(sched: Schedule, costs: AnyCosts) -> Schedule:
    """A reordering of ``sched`` (same placement and micro-batches) that is never slower under
    ``costs`` and never raises any rank's peak live activations; deterministic."""
    model = _Model(sched, costs)
    base_lists = [[model.enc(op) for op in ops] for ops in sched.ops]
    caps = [peak_live_activations(ops) for ops in sched.ops]
    base = simulate(sched, costs)

    candidates: list[tuple[tuple[float, float], int, Lists]] = []
    seeds: list[Lists] = [base_lists]
    built: list[tuple[tuple[float, float], Lists]] = []
    for rule in _RULES:
        order = _list_schedule(model, caps, rule)
        if order is None:
            continue
        lists = [[model.enc(op) for op in ops] for ops in order]
        t = model.time(lists)
        if t is not None and all(peak(o) <= cap for o, cap in zip(lists, caps)):
            built.append((_score(t), lists))
    if built:
        seeds.append(min(built, key=lambda x: x[0])[1])
    n_ops = sum(map(len, base_lists))
    budget = max(_MIN_EVALS, min(_MAX_EVALS, _SEARCH_WORK // max(1, n_ops)))
    for seed in seeds:
        lists, t = _local_search(model, [list(o) for o in seed], caps, budget)
        candidates.append((_score(t), len(candidates), lists))
    for score, _, lists in sorted(candidates, key=lambda x: (x[0], x[1])):
        if score[0] >= float(base.makespan):
            break
        out = Schedule(f"{sched.name}-optimized", sched.ranks, sched.stages, sched.microbatches,
                       sched.directions, [[o.op for o in ops] for ops in lists], dict(sched.placement))
        if _no_worse(out, sched, costs, base.makespan):
            return out
    return Schedule(f"{sched.name}-optimized", sched.ranks, sched.stages, sched.microbatches,
                    sched.directions, [list(ops) for ops in sched.ops], dict(sched.placement))


def _no_worse(new: Schedule, old: Schedule, costs: AnyCosts, makespan) -> bool:
    """The exact check: valid, no longer, and no rank holding more live activations."""
    result = simulate(new, costs)  # validates
    return result.makespan <= makespan and all(
        peak_live_activations(a) <= peak_live_activations(b) for a, b in zip(new.ops, old.ops))


__all__ = ["optimize_order"]
