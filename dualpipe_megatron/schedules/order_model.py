"""The op-order search's model of one schedule (:mod:`.optimize`): each op's float duration by
the costs' own rule, worked out once per kind and stage; each op encoded once for the events
core's timing; and orders packed as int64 codes, which workers hand each other far faster than
op objects."""

from __future__ import annotations

from array import array
from typing import NamedTuple, Optional

from .events import Encoder, TimedOp, Timing, timing
from .ir import B, F, FB, Key, Op, Schedule, W
from .simulate import AnyCosts, StageCosts

INF = float("inf")


class OrderModel:
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
        self._singles_of: dict[tuple[int, int], Singles] = {}
        self._pairs: dict[tuple[int, int, int, int, int, int, bool], FB] = {}
        self._singles = 4 * self.directions * self.stages * self.per  # codes of single ops (pack)
        self.spent = 0  # ops timed so far: the search's work
        # per rank, the (F stage, B stage) combinations whose F&B pair is shorter than the two alone
        self.saving_pairs = [[(f, b) for f in on for b in on if self.pair_saves(f, b) > 0] for on in self.stages_on]

    def enc(self, op: Op) -> TimedOp:
        """The op's events and cost, its dependencies by the events core's rules."""
        got = self._cache.get(op)
        if got is None:
            got = self._cache[op] = self.encoder.encode(op, len(self.durations), self.c, 0.0)
            self.durations.append(self.duration(op))
        return got

    def singles(self, ds: tuple[int, int]) -> "Singles":
        """Stage ``ds``'s single ops by micro-batch (F, B(w=false), B, W), made once and shared,
        so that the list scheduler does not build an op object per op it places."""
        got = self._singles_of.get(ds)
        if got is None:
            keys = [Key(*ds, m) for m in range(self.per)]
            got = self._singles_of[ds] = Singles([F(k) for k in keys], [B(k, False) for k in keys],
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
        its field in :class:`Singles` (F, B(w=false), B, W); an F&B pair's is N + f * N + b, N
        the number of single codes."""
        n, single = self._singles, self._single
        return [array("q", [n + single(op.f) * n + single(op.b) if isinstance(op, FB) else single(op)
                            for op in row]).tobytes() for row in ops]

    def _single(self, op: Op) -> int:
        k = op.key
        return ((Singles.field(op) * self.directions + k.d) * self.stages + k.s) * self.per + k.m

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
            kind_at = (Singles.field(op), op.key.d, op.key.s)
        got = self._by_kind.get(kind_at)
        if got is None:
            got = self._by_kind[kind_at] = float(self.costs.duration(op))
        return got

    def pair_saves(self, f: tuple[int, int], b: tuple[int, int]) -> float:
        """What running stage ``f``'s F and stage ``b``'s full B as one F&B pair saves."""
        pair = FB(F(Key(*f, 0)), B(Key(*b, 0), True))
        return self.F[f] + self.B[b] - self.duration(pair)


Lists = list[list[TimedOp]]


class Singles(NamedTuple):
    """One stage's single ops by micro-batch (:meth:`OrderModel.singles`); a field's index is its
    kind's code in :meth:`OrderModel.pack`."""

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


Packed = list[bytes]  # an order as int64 codes, one array per rank (:meth:`OrderModel.pack`)


def order_score(t: Timing) -> tuple[float, float]:
    """Makespan first; the sum of all start times breaks ties, so that near-critical paths shrink too."""
    return t.makespan, sum(map(sum, t.start))
