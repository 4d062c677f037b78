"""Exact-arithmetic timing of a schedule under the contract's cost model.

Each op starts when its rank is free and its inputs have arrived (the
producer's end, plus the p2p latency ``c`` when the producer is another rank).
Times are :class:`fractions.Fraction`, so formulas can be checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Rational
from typing import Union

from .ir import B, F, Op, Schedule, ScheduleError, W, halves
from .validate import Event, op_needs, produces, validate

Number = Union[int, float, str, Fraction]


def exact(value: Number) -> Fraction:
    """A cost as an exact fraction; floats go through their decimal text (0.8 is 4/5)."""
    if isinstance(value, Rational):
        return Fraction(value)
    return Fraction(str(value))


@dataclass(frozen=True)
class Costs:
    """Op costs: F, full B, its W part, an overlapped F&B pair, and p2p latency c."""

    F: Fraction = Fraction(1)
    B: Fraction = Fraction(2)
    W: Fraction = Fraction(1)
    FB: Fraction = Fraction(3)
    c: Fraction = Fraction(0)

    @classmethod
    def of(cls, F: Number = 1, B: Number = 2, W: Number = 1, FB: Number = 3, c: Number = 0) -> "Costs":
        costs = cls(exact(F), exact(B), exact(W), exact(FB), exact(c))
        for name in ("F", "B", "W", "FB"):
            if getattr(costs, name) <= 0:
                raise ScheduleError(f"cost {name} must be positive, got {getattr(costs, name)}")
        if costs.W >= costs.B:
            raise ScheduleError(f"cost W ({costs.W}) must be less than B ({costs.B})")
        if costs.W >= costs.FB:
            raise ScheduleError(f"cost W ({costs.W}) must be less than FB ({costs.FB})")
        if costs.c < 0:
            raise ScheduleError(f"p2p latency c must be >= 0, got {costs.c}")
        return costs

    def scaled(self, factor: Fraction) -> "Costs":
        """Compute costs times ``factor`` (a smaller stage), p2p latency unchanged."""
        return Costs(self.F * factor, self.B * factor, self.W * factor, self.FB * factor, self.c)

    def duration(self, op: Op) -> Fraction:
        if isinstance(op, F):
            return self.F
        if isinstance(op, B):
            return self.B if op.w else self.B - self.W
        if isinstance(op, W):
            return self.W
        return self.FB if op.b.w else self.FB - self.W


@dataclass
class RankStats:
    rank: int
    busy: Fraction
    bubble: Fraction
    peak_activations: int
    stages: int
    ops: int


@dataclass
class SimResult:
    """Timeline and per-rank figures of one simulated step."""

    schedule: Schedule
    costs: Costs
    makespan: Fraction
    start: list[list[Fraction]]
    end: list[list[Fraction]]
    per_rank: list[RankStats]
    extra: dict = field(default_factory=dict)

    @property
    def max_bubble(self) -> Fraction:
        return max(r.bubble for r in self.per_rank)

    @property
    def min_bubble(self) -> Fraction:
        return min(r.bubble for r in self.per_rank)

    @property
    def mean_bubble(self) -> Fraction:
        return sum((r.bubble for r in self.per_rank), Fraction(0)) / len(self.per_rank)

    @property
    def bubble_ratio(self) -> Fraction:
        """Idle share of all rank-time: sum of bubbles over ranks x makespan."""
        return sum((r.bubble for r in self.per_rank), Fraction(0)) / (
            self.makespan * len(self.per_rank)
        )

    @property
    def peak_activations(self) -> int:
        return max(r.peak_activations for r in self.per_rank)

    @property
    def model_copies(self) -> int:
        """How many copies of each layer the schedule holds across all devices."""
        return self.schedule.directions

    @property
    def params_per_rank(self) -> Fraction:
        """Largest share of the model's layers one rank holds (1/P for 1F1B on P ranks)."""
        per_copy = self.schedule.stages
        return max(Fraction(s.stages, per_copy) for s in self.per_rank)


def peak_live_activations(ops: list[Op]) -> int:
    """Peak count of (d,s,m) live on a rank: from its F's start until its weight grad is done.

    A rank runs its ops one at a time, so the count depends only on op order.
    """
    live = peak = 0
    for op in ops:
        live += sum(isinstance(h, F) for h in halves(op))
        peak = max(peak, live)
        live -= sum(isinstance(h, W) or (isinstance(h, B) and h.w) for h in halves(op))
    return peak


def simulate(sched: Schedule, costs: Costs) -> SimResult:
    """Validate ``sched`` and time it; raises if the schedule is invalid."""
    order = validate(sched)
    start = [[Fraction(0)] * len(ops) for ops in sched.ops]
    end = [[Fraction(0)] * len(ops) for ops in sched.ops]
    made: dict[Event, tuple[int, Fraction]] = {}
    free = [Fraction(0)] * sched.ranks
    for rank, index in order:
        op = sched.ops[rank][index]
        ready = free[rank]
        for event in op_needs(op, sched.stages):
            src, t = made[event]
            ready = max(ready, t + (costs.c if src != rank else 0))
        start[rank][index] = ready
        end[rank][index] = free[rank] = ready + costs.duration(op)
        for event in produces(op):
            made[event] = (rank, end[rank][index])
    makespan = max(free)
    per_rank = []
    for rank, ops in enumerate(sched.ops):
        busy = sum((costs.duration(op) for op in ops), Fraction(0))
        per_rank.append(
            RankStats(
                rank=rank,
                busy=busy,
                bubble=makespan - busy,
                peak_activations=peak_live_activations(ops),
                stages=len(sched.stages_on(rank)),
                ops=len(ops),
            )
        )
    return SimResult(sched, costs, makespan, start, end, per_rank)


__all__ = ["Costs", "RankStats", "SimResult", "exact", "peak_live_activations", "simulate"]
