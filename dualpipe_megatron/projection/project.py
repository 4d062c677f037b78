"""Step time, bubble and memory of the schedules for one job, from per-stage op times.

Every schedule runs the same model on the same ``P`` devices and the same
``M`` micro-batches per step (DualPipe: ``M/2`` per direction). Stage costs
are for 1/P of the model; a schedule that cuts it into more stages per copy
(interleaved, DualPipeV) runs proportionally cheaper stages, while the p2p
latency stays per transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..schedules.ir import B, F, FB, Schedule, ScheduleError
from ..schedules.registry import build_schedule
from ..schedules.simulate import SimResult, simulate
from .costs import StageTimes, exposed_a2a, schedule_costs


@dataclass(frozen=True)
class Variant:
    """A schedule as projected: which generator, and whether its F&B pairs hide the all-to-all."""

    label: str
    generator: str
    overlap: bool  # all-to-all hidden in F&B pairs
    megatron_pairs: bool = False  # rebuild as Megatron's combined 1F1B


VARIANTS = [
    Variant("1f1b", "1f1b", False),
    Variant("interleaved", "interleaved", False),
    Variant("interleaved+a2a", "interleaved", True, megatron_pairs=True),
    Variant("zb1p", "zb1p", False),
    Variant("dualpipe", "dualpipe", True),
    Variant("dualpipev", "dualpipev", True),
]


def megatron_combined_1f1b(sched: Schedule) -> Schedule:
    """Megatron's order under ``--overlap-moe-expert-parallel-comm``.

    Megatron warms up with one forward more than plain (interleaved) 1F1B so
    that the two halves of every steady-state step are independent, then runs
    each step's forward and backward as one overlapped pair; the cool-down
    backwards run alone. Only for schedules made of plain F and B ops.
    """
    ops = []
    for rank_ops in sched.ops:
        fwd = [op for op in rank_ops if isinstance(op, F)]
        bwd = [op for op in rank_ops if isinstance(op, B)]
        if len(fwd) + len(bwd) != len(rank_ops):
            raise ScheduleError(f"{sched.name}: only F/B schedules have a combined 1F1B form")
        # The plain order's leading forwards are its warm-up plus the first step's forward.
        warm = next((i for i, op in enumerate(rank_ops) if not isinstance(op, F)), len(rank_ops))
        steady = len(fwd) - warm
        ops.append(fwd[:warm] + [FB(fwd[warm + k], bwd[k]) for k in range(steady)]
                   + bwd[steady:])
    return Schedule(sched.name + "+a2a", sched.ranks, sched.stages, sched.microbatches,
                    sched.directions, ops, dict(sched.placement))


@dataclass(frozen=True)
class Projection:
    """One schedule's projected step, in ms and in units of the model."""

    variant: Variant
    result: SimResult
    stage_fraction: Fraction  # one stage as a share of a 1/P stage
    exposed_a2a_ms: float  # most all-to-all time left exposed on any rank

    @property
    def peak_stage_activations(self) -> Fraction:
        """Peak live micro-batches, in units of one 1/P stage's activations."""
        return self.result.peak_activations * self.stage_fraction


def build_variant(v: Variant, ranks: int, microbatches: int, chunks: int) -> Schedule:
    sched = build_schedule(v.generator, ranks, microbatches,
                           chunks if v.generator == "interleaved" else None)
    return megatron_combined_1f1b(sched) if v.megatron_pairs else sched


def project(times: StageTimes, ranks: int, microbatches: int, chunks: int, loss: float,
            variants: list[Variant] = VARIANTS) -> list[Projection | ScheduleError]:
    """Simulate each variant; a schedule the shape does not allow comes back as its error."""
    out: list[Projection | ScheduleError] = []
    for v in variants:
        try:
            sched = build_variant(v, ranks, microbatches, chunks)
        except ScheduleError as exc:
            out.append(exc)
            continue
        fraction = Fraction(ranks, sched.stages)
        res = simulate(sched, schedule_costs(times, v.overlap, loss).scaled(fraction))
        exposed = max(sum(exposed_a2a(op, times, loss) for op in rank_ops)
                      for rank_ops in sched.ops) * float(fraction)
        out.append(Projection(v, res, fraction, exposed))
    return out


__all__ = ["Projection", "VARIANTS", "Variant", "build_variant", "megatron_combined_1f1b",
           "project"]
