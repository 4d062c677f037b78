"""Iterated local search on the critical path for the op-order search (:mod:`.optimize`): moves
that swap, split or pair F&B, defer or move weight grads along one critical path, kept when the
step (or, as a tie-break, the sum of start times) shrinks; seeded random moves when it stalls.
Bounded by work (op-simulations), not time, so it is deterministic."""

from __future__ import annotations

import random

from .events import TimedOp, Timing, peak
from .ir import B, F, FB, W
from .order_model import Lists, OrderModel, order_score

_KICK_MOVES = 3  # random moves per kick of the iterated local search


def _critical_path(model: OrderModel, lists: Lists, t: Timing) -> list[tuple[int, int]]:
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


def moves_at(model: OrderModel, ops: list[TimedOp], i: int):
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


def _descend(model: OrderModel, lists: Lists, t: Timing, caps: list[int], until: int) -> tuple[Lists, Timing]:
    """First-improvement descent over :func:`moves_at` along the critical path, until the model
    has spent ``until`` op-simulations."""
    best = order_score(t)
    improved = True
    while improved and model.spent < until:
        improved = False
        for r, i in _critical_path(model, lists, t):
            for at, changed in moves_at(model, lists[r], i):
                if peak(changed) > caps[r]:
                    continue
                old, lists[r] = lists[r], changed
                trial = model.time(lists, (t, r, at))
                if trial is not None and trial.makespan <= best[0] and order_score(trial) < best:  # sums only if needed
                    t, best, improved = trial, order_score(trial), True
                    break
                lists[r] = old
                if model.spent >= until:
                    return lists, t
            if improved:
                break
    return lists, t


def _kick(model: OrderModel, lists: Lists, caps: list[int], rng: random.Random, tries: int) -> Lists:
    """A few random valid moves anywhere (not only on the critical path), to leave a local optimum."""
    out = [list(o) for o in lists]
    for _ in range(_KICK_MOVES):
        for _ in range(tries):
            r = rng.randrange(len(out))
            if not out[r]:
                continue
            moves = [m for _, m in moves_at(model, out[r], rng.randrange(len(out[r]))) if peak(m) <= caps[r]]
            if not moves:
                continue
            old, out[r] = out[r], rng.choice(moves)
            if model.time(out) is not None:
                break
            out[r] = old
    return out


def local_search(model: OrderModel, lists: Lists, caps: list[int], work: int) -> tuple[Lists, Timing]:
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
        if order_score(tt) < order_score(best_t):
            best, best_t = [list(o) for o in trial], tt
    return best, best_t
