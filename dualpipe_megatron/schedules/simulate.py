"""Exact-arithmetic timing of a schedule under the contract's cost model.

Each op starts when its rank is free and its inputs have arrived (the
producer's end, plus the p2p latency ``c`` when the producer is another rank):
the events core's timer (:func:`~.events.timing`). Times are
:class:`fractions.Fraction`, so formulas can be checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from numbers import Rational
from typing import Union

from .events import Encoder, peak, timing
from .ir import FB, B, F, Op, Schedule, ScheduleError, W
from .validate import validate

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


@dataclass(frozen=True)
class StageCost:
    """One (direction, stage)'s forward, full backward and the weight-grad part of it.

    ``Fo`` and ``Bo`` (optional, default 0) are what an overlapped F&B pair saves on this
    stage's F and B, beyond ``fb_ratio``: the projection puts the hidden share of the MoE
    all-to-all there, which dense stages do not have.
    """

    F: Fraction
    B: Fraction
    W: Fraction
    Fo: Fraction = Fraction(0)
    Bo: Fraction = Fraction(0)

    def __add__(self, other: "StageCost") -> "StageCost":
        return StageCost(*(getattr(self, f) + getattr(other, f) for f in STAGE_FIELDS))

    def __mul__(self, factor: Fraction) -> "StageCost":
        return StageCost(*(getattr(self, f) * factor for f in STAGE_FIELDS))


STAGE_FIELDS = ("F", "B", "W", "Fo", "Bo")


@dataclass(frozen=True)
class StageCosts:
    """Per-stage op costs: real stages differ (embedding, loss, dense vs MoE layers, MTP).

    An overlapped F&B pair of F on stage f and B on stage b costs ``fb_ratio * (F_f + B_b)``,
    less ``Fo_f + Bo_b``, less ``W_b`` when its weight grad is deferred. The file form
    (``--stage-costs``) is ``{"c": .., "fb_ratio": .., "stages": [{"d": 0, "s": 0, "F": .., "B": ..,
    "W": ..}, ...]}``; an entry may add ``"Fo"`` and ``"Bo"``.
    """

    stages: dict[tuple[int, int], StageCost]
    fb_ratio: Fraction = Fraction(1)
    c: Fraction = Fraction(0)

    @classmethod
    def from_json_obj(cls, obj: object) -> "StageCosts":
        if not isinstance(obj, dict) or not isinstance(obj.get("stages"), list) or not obj["stages"]:
            raise ScheduleError('stage costs: expected {"c": .., "fb_ratio": .., "stages": [{"d", "s", "F", "B", "W"}, ...]}')
        stages: dict[tuple[int, int], StageCost] = {}
        for entry in obj["stages"]:
            try:
                where = (int(entry["d"]), int(entry["s"]))
                cost = StageCost(exact(entry["F"]), exact(entry["B"]), exact(entry["W"]),
                                 exact(entry.get("Fo", 0)), exact(entry.get("Bo", 0)))
            except (AttributeError, KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                raise ScheduleError(f"stage costs: bad entry {entry!r} ({exc})") from None
            if where in stages:
                raise ScheduleError(f"stage costs: (d={where[0]}, s={where[1]}) given twice")
            if cost.F <= 0 or cost.B <= 0 or not 0 <= cost.W < cost.B:
                raise ScheduleError(f"stage costs: (d={where[0]}, s={where[1]}) needs F > 0, B > 0, 0 <= W < B")
            if not (0 <= cost.Fo < cost.F and 0 <= cost.Bo < cost.B - cost.W):
                raise ScheduleError(f"stage costs: (d={where[0]}, s={where[1]}) needs 0 <= Fo < F, 0 <= Bo < B - W")
            stages[where] = cost
        try:
            ratio, c = exact(obj.get("fb_ratio", 1)), exact(obj.get("c", 0))
        except (TypeError, ValueError, ZeroDivisionError) as exc:
            raise ScheduleError(f"stage costs: bad fb_ratio or c ({exc})") from None
        if ratio <= 0 or c < 0:
            raise ScheduleError(f"stage costs: fb_ratio must be > 0 and c >= 0, got {ratio} and {c}")
        return cls(stages, ratio, c)

    def to_json_obj(self) -> dict:
        return {"c": float(self.c), "fb_ratio": float(self.fb_ratio),
                "stages": [{"d": d, "s": s, **{f: float(getattr(v, f)) for f in STAGE_FIELDS
                                               if f in ("F", "B", "W") or getattr(v, f)}}
                           for (d, s), v in sorted(self.stages.items())]}

    @classmethod
    def uniform(cls, sched: Schedule, costs: Costs) -> "StageCosts":
        """``costs`` on every stage of ``sched`` (the pair ratio is FB / (F + B))."""
        one = StageCost(costs.F, costs.B, costs.W)
        return cls({key: one for key in sched.placement}, costs.FB / (costs.F + costs.B), costs.c)

    def check_covers(self, sched: Schedule) -> None:
        """The costs describe exactly ``sched``'s stages (another split's costs would mislead)."""
        if set(sched.placement) != set(self.stages):
            directions = 1 + max(d for d, _ in self.stages)
            raise ScheduleError(
                f"stage costs are for {len(self.stages)} (direction, stage) pairs ({directions} direction(s)), "
                f"{sched.name} has {sched.directions} x {sched.stages}")

    def duration(self, op: Op) -> Fraction:
        if isinstance(op, FB):
            f, b = self.stages[(op.f.key.d, op.f.key.s)], self.stages[(op.b.key.d, op.b.key.s)]
            return self.fb_ratio * (f.F + b.B) - f.Fo - b.Bo - (0 if op.b.w else b.W)
        cost = self.stages[(op.key.d, op.key.s)]
        if isinstance(op, F):
            return cost.F
        if isinstance(op, B):
            return cost.B if op.w else cost.B - cost.W
        return cost.W


AnyCosts = Union[Costs, StageCosts]


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
    costs: AnyCosts
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


def simulate(sched: Schedule, costs: AnyCosts) -> SimResult:
    """Validate ``sched`` and time it; raises if the schedule is invalid."""
    validate(sched)
    if isinstance(costs, StageCosts):
        costs.check_covers(sched)
    encoder, zero = Encoder(sched), Fraction(0)
    durations: list[Fraction] = []
    lists = []
    for ops in sched.ops:
        lists.append([encoder.encode(op, len(durations) + i, costs.c, zero) for i, op in enumerate(ops)])
        durations += [costs.duration(op) for op in ops]
    timed = timing(lists, durations, encoder.size, zero)
    end = [[t + durations[o.cost] for t, o in zip(starts, row)] for starts, row in zip(timed.start, lists)]
    per_rank = []
    for rank, row in enumerate(lists):
        busy = sum((durations[o.cost] for o in row), zero)
        per_rank.append(
            RankStats(
                rank=rank,
                busy=busy,
                bubble=timed.makespan - busy,
                peak_activations=peak(row),
                stages=len(sched.stages_on(rank)),
                ops=len(row),
            )
        )
    return SimResult(sched, costs, timed.makespan, timed.start, end, per_rank)


__all__ = ["AnyCosts", "Costs", "RankStats", "STAGE_FIELDS", "SimResult", "StageCost", "StageCosts", "exact",
           "simulate"]
