"""Measured bubbles of a traced run, and what the simulator predicts from the measured op costs.

Per training step of one pipeline: the makespan runs from the first rank's step
start to the last rank's step end; a rank's busy time is the sum of its ops'
compute time (op span minus receive waits); its bubble is makespan minus busy,
the simulator's definition. The prediction takes the median measured cost of
each op kind as :class:`Costs` (p2p latency 0) and simulates the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from statistics import median
from typing import Sequence

from ..schedules.ir import FB, Schedule
from ..schedules.simulate import Costs, SimResult, StageCost, StageCosts, simulate
from .records import RankTrace, StepRecord, TraceError, pipelines, step_schedule

NS_PER_MS = 1_000_000


@dataclass(frozen=True)
class StepBubbles:
    """One training step of one pipeline, in ms."""

    step: int
    makespan: float
    busy: list[float]  # per pipeline rank
    wait: list[float]  # receive waits per pipeline rank

    @property
    def bubble(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        """Idle share of all rank-time (the simulator's bubble ratio)."""
        return sum(self.bubble) / (self.makespan * len(self.busy))


@dataclass(frozen=True)
class Timeline:
    """Per-rank op start/end times in ms from the step's start, indexed like the schedule's op lists."""

    start: list[list[float]]
    end: list[list[float]]


@dataclass(frozen=True)
class PipelineReport:
    """Measured steps of one pipeline and the prediction from their op costs (all in ms)."""

    pipeline: tuple[int, ...]
    schedule: Schedule
    steps: list[StepBubbles]  # the analysed training steps
    skipped: int
    costs: Costs
    op_medians: dict[str, float]  # median compute ms per recorded op kind
    prediction: SimResult

    def median_step(self) -> StepBubbles:
        """The analysed step of median makespan (a typical one to look at)."""
        ordered = sorted(self.steps, key=lambda s: s.makespan)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def measured_ratio(self) -> float:
        return median(s.bubble_ratio for s in self.steps)

    @property
    def predicted_ratio(self) -> float:
        return float(self.prediction.bubble_ratio)


def training_steps(ranks: list[RankTrace]) -> list[int]:
    """Indices of the steps every rank of the pipeline recorded as training steps."""
    count = min(len(r.steps) for r in ranks)
    kept = []
    for i in range(count):
        flags = {r.steps[i].forward_only for r in ranks}
        if len(flags) > 1:
            raise TraceError(f"step {i}: ranks disagree on forward-only; the traces do not line up")
        if flags == {False}:
            kept.append(i)
    return kept


def step_bubbles(ranks: list[RankTrace], index: int) -> StepBubbles:
    steps: list[StepRecord] = [r.steps[index] for r in ranks]
    begin, end = min(s.begin for s in steps), max(s.end for s in steps)
    return StepBubbles(
        step=index, makespan=(end - begin) / NS_PER_MS,
        busy=[sum(o.busy for o in s.ops) / NS_PER_MS for s in steps],
        wait=[sum(o.wait for o in s.ops) / NS_PER_MS for s in steps],
    )


def step_timeline(ranks: list[RankTrace], index: int) -> Timeline:
    """Measured compute spans of one step (receive waits excluded), for drawing."""
    steps = [r.steps[index] for r in ranks]
    begin = min(s.begin for s in steps)
    return Timeline(start=[[(o.start - begin) / NS_PER_MS for o in s.ops] for s in steps],
                    end=[[(o.end - begin) / NS_PER_MS for o in s.ops] for s in steps])


def measured_costs(ranks: list[RankTrace], indices: Sequence[int]) -> tuple[Costs, dict[str, float]]:
    """Median compute ms per op kind, and the :class:`Costs` they imply.

    An input-grad-only B or FB plus the median W estimates the full one; with
    no W ops at all, W gets a token 1 ns (the simulator wants it positive).
    """
    samples: dict[str, list[int]] = {}
    for r in ranks:
        for i in indices:
            for o in r.steps[i].ops:
                samples.setdefault(o.kind, []).append(o.busy)
    w = max(1, round(median(samples.get("W", [1]))))

    def full(kind: str) -> int | None:
        values = samples.get(kind, []) + [v + w for v in samples.get(f"{kind} (input grad)", [])]
        return round(median(values)) if values else None

    f, b, fb = full("F"), full("B"), full("FB")
    if f is None or b is None:
        raise TraceError("need both F and B ops to estimate op costs")
    costs = Costs.of(F=Fraction(f, NS_PER_MS), B=Fraction(b, NS_PER_MS), W=Fraction(w, NS_PER_MS),
                     FB=Fraction(fb if fb is not None else f + b, NS_PER_MS))
    return costs, {kind: median(v) / NS_PER_MS for kind, v in sorted(samples.items())}


def measured_stage_costs(ranks: list[RankTrace], indices: Sequence[int]) -> StageCosts:
    """Median compute ms of F, full B and W per (direction, stage), and the F&B pair ratio.

    A B without its weight grad plus the stage's median W estimates the full B; a stage whose F
    (or B) only ran inside F&B pairs takes the median over all stages; the pair ratio is the
    median over F&B ops of (measured + deferred W) / (F of its forward stage + B of its backward
    stage). The p2p latency is left 0, as in :func:`measured_costs`.
    """
    samples: dict[tuple[str, int, int], list[int]] = {}
    pairs: list[tuple[int, tuple[int, int], tuple[int, int], bool]] = []
    for r in ranks:
        for i in indices:
            for o in r.steps[i].ops:
                if isinstance(o.op, FB):
                    pairs.append((o.busy, (o.op.f.key.d, o.op.f.key.s), (o.op.b.key.d, o.op.b.key.s), o.op.b.w))
                    continue
                kind = o.kind if o.kind != "B (input grad)" else "Bi"
                samples.setdefault((kind, o.op.key.d, o.op.key.s), []).append(o.busy)
    where = sorted(step_schedule(ranks, indices[0]).placement)

    def med(kind: str, stage: tuple[int, int] | None) -> float | None:
        values = [v for (k, d, s), vs in samples.items() if k == kind and (stage is None or (d, s) == stage)
                  for v in vs]
        return median(values) if values else None

    stages: dict[tuple[int, int], StageCost] = {}
    for stage in where:
        w = med("W", stage) or med("W", None) or 0.0
        b_values = [v for v in samples.get(("B", *stage), [])] + [v + w for v in samples.get(("Bi", *stage), [])]
        b = median(b_values) if b_values else None
        f = med("F", stage)
        if b is None:
            every = [v for (k, _, _), vs in samples.items() if k == "B" for v in vs] + \
                    [v + w for (k, _, _), vs in samples.items() if k == "Bi" for v in vs]
            b = median(every) if every else None
        f = f if f is not None else med("F", None)
        if f is None or b is None:
            raise TraceError("need F and B ops (outside F&B pairs) to estimate stage costs")
        stages[stage] = StageCost(_ms(f), _ms(b), _ms(min(w, b / 2)))
    ratios = [(busy + (0 if w_done else float(stages[bs].W) * NS_PER_MS))
              / float((stages[fs].F + stages[bs].B) * NS_PER_MS) for busy, fs, bs, w_done in pairs]
    return StageCosts(stages, Fraction(median(ratios)).limit_denominator(10_000) if ratios else Fraction(1))


def _ms(ns: float) -> Fraction:
    return Fraction(round(ns), NS_PER_MS)


def kept_steps(ranks: list[RankTrace], skip: int = 1) -> list[int]:
    """The training steps after the first ``skip`` (warm-up) of the last step's shape (a
    batch-size ramp-up changes the micro-batch count)."""
    indices = training_steps(ranks)
    if len(indices) <= skip:
        raise TraceError(f"pipeline {list(ranks[0].pipeline)}: {len(indices)} training step(s) traced, "
                         f"none left after skipping {skip}")
    shape = ranks[0].steps[indices[-1]].shape
    return [i for i in indices[skip:] if ranks[0].steps[i].shape == shape]


@dataclass(frozen=True)
class StageCostFit:
    """Stage costs measured from a run, and how well they predict its step: the simulated
    makespan of the schedule the run executed against the measured median (ms)."""

    costs: StageCosts
    schedule: Schedule
    steps: int
    predicted_ms: float
    measured_ms: float

    @property
    def error(self) -> float:
        return self.predicted_ms / self.measured_ms - 1


def stage_cost_fit(ranks: list[RankTrace], skip: int = 1) -> StageCostFit:
    """:func:`measured_stage_costs` of the :func:`kept_steps`, simulated (what ``trace costs`` writes)."""
    kept = kept_steps(ranks, skip)
    costs = measured_stage_costs(ranks, kept)
    sched = step_schedule(ranks, kept[0])
    return StageCostFit(costs, sched, len(kept), float(simulate(sched, costs).makespan),
                        median(step_bubbles(ranks, i).makespan for i in kept))


def analyze_pipeline(ranks: list[RankTrace], skip: int = 1) -> PipelineReport:
    """Bubbles of the kept training steps (:func:`kept_steps`), and the prediction."""
    kept = kept_steps(ranks, skip)
    sched = step_schedule(ranks, kept[0])
    costs, op_medians = measured_costs(ranks, kept)
    return PipelineReport(ranks[0].pipeline, sched, [step_bubbles(ranks, i) for i in kept],
                          len(training_steps(ranks)) - len(kept), costs, op_medians, simulate(sched, costs))


def analyze(traces: list[RankTrace], skip: int = 1) -> list[PipelineReport]:
    return [analyze_pipeline(ranks, skip) for ranks in pipelines(traces)]


__all__ = ["PipelineReport", "StageCostFit", "StepBubbles", "Timeline", "analyze", "analyze_pipeline",
           "measured_costs", "kept_steps", "measured_stage_costs", "stage_cost_fit",
           "step_bubbles", "step_timeline", "training_steps"]
