"""Step time, bubble and memory of the schedules for one job, from per-stage op times.

Every schedule runs the same model on the same ``P`` devices and the same
``M`` micro-batches per step (DualPipe: ``M/2`` per direction). The placement
(:mod:`.placement`) says what each schedule's stages cost: equal shares of the
model, a stage-cost file, or the whole model layer by layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from ..schedules.events import peak_live_activations
from ..schedules.ir import B, F, FB, Schedule, ScheduleError
from ..schedules.optimize import min_activations, optimize_order
from ..schedules.registry import build_schedule
from ..schedules.simulate import SimResult, simulate
from .placement import Placement, Plan, weighted_peak


@dataclass(frozen=True)
class Variant:
    """A schedule as projected: which generator, and whether its F&B pairs hide the all-to-all."""

    label: str
    generator: str
    overlap: bool  # all-to-all hidden in F&B pairs
    megatron_pairs: bool = False  # rebuild as Megatron's combined 1F1B
    chunks: int | None = None  # interleaved: chunks per rank
    auto_layout: bool = False  # layers per stage from the layout search (realistic placement)
    optimize: bool = False  # op order from the optimizer, for the placement's stage costs
    budget: Fraction | None = None  # optimize within this fraction of DeepSeek's order's peak


def variants(chunks: Sequence[int] = (2, 4), auto_layout: bool = False,
             budgets: Sequence[Fraction] = ()) -> list[Variant]:
    """The projected rows: Megatron's schedules, the anchors and ours; with ``auto_layout``,
    DualPipe(V) also with the layout search, then with the op-order optimizer on top; one
    DualPipeV row per activation budget in ``budgets`` (fractions of DeepSeek's order's
    peak of live (d,s,m) per rank, the optimizer's ``max_activations`` unit)."""
    out = [Variant("1f1b", "1f1b", False)]
    for v in chunks:
        out += [Variant(f"interleaved-{v}", "interleaved", False, chunks=v),
                Variant(f"interleaved-{v}+a2a", "interleaved", True, megatron_pairs=True, chunks=v)]
        if auto_layout:  # Megatron takes any split as --pipeline-model-parallel-layout
            out.append(Variant(f"interleaved-{v}+a2a auto", "interleaved", True, megatron_pairs=True,
                               chunks=v, auto_layout=True))
    out += [Variant("zb1p", "zb1p", False), Variant("zbv", "zbv", False),
            Variant("vhalf", "vhalf", False), Variant("chimera", "chimera", False)]
    for name in ("dualpipe", "dualpipev"):
        out.append(Variant(name, name, True))
        if auto_layout:
            out += [Variant(f"{name} auto", name, True, auto_layout=True),
                    Variant(f"{name} auto+opt", name, True, auto_layout=True, optimize=True)]
        else:
            out.append(Variant(f"{name}+opt", name, True, optimize=True))
    opt = "dualpipev auto+opt" if auto_layout else "dualpipev+opt"
    out += [Variant(f"{opt} budget {b}", "dualpipev", True, auto_layout=auto_layout, optimize=True,
                    budget=b) for b in budgets]
    return out


VARIANTS = variants()


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
    peak_stage_activations: Fraction  # most live activations on a rank, in 1/P stages
    params_stages: Fraction  # most parameters on a rank, in 1/P stages
    exposed_a2a_ms: float | None  # most all-to-all time left exposed on any rank
    layout: str | None = None  # layers per stage, as a Megatron layout string
    peak_live: int = 0  # most live (d,s,m) on a rank, unweighted (the budget's unit)
    max_activations: int | None = None  # the budget the order was optimized within
    clamped: bool = False  # the budget's fraction fell below the minimum any order needs
    order: Schedule | None = None  # the op order simulated (e.g. to weigh its stages' own bytes)


def activation_budget(sched: Schedule, fraction: Fraction) -> tuple[int, bool]:
    """``ceil(fraction x`` the peak of ``sched``'s own order), raised to the minimum any order
    needs (:func:`~..schedules.optimize.min_activations`); and whether it was raised."""
    peak = max(peak_live_activations(ops) for ops in sched.ops)
    want = math.ceil(fraction * peak)
    floor = min_activations(sched)
    return max(want, floor), want < floor


def build_variant(v: Variant, ranks: int, microbatches: int) -> Schedule:
    sched = build_schedule(v.generator, ranks, microbatches, v.chunks)
    return megatron_combined_1f1b(sched) if v.megatron_pairs else sched


def project(placement: Placement, ranks: int, microbatches: int,
            rows: Sequence[Variant] = VARIANTS) -> list[Projection | ScheduleError]:
    """Simulate each variant; a schedule the shape does not allow comes back as its error."""
    out: list[Projection | ScheduleError] = []
    for v in rows:
        try:
            sched = build_variant(v, ranks, microbatches)
            plan = placement.plan(sched, v.overlap, v.auto_layout)
            budget, clamped = activation_budget(sched, v.budget) if v.budget is not None else (None, False)
            if v.optimize:
                sched = optimize_order(sched, plan.costs, max_activations=budget)
        except ScheduleError as exc:
            out.append(ScheduleError(f"{v.label}: {exc}"))
            continue
        out.append(_measured(v, sched, plan, budget, clamped))
    return out


def project_order(placement: Placement, v: Variant, sched: Schedule,
                  max_activations: int | None = None) -> Projection:
    """``sched``'s op order exactly as given (e.g. the one a training job runs, which row ``v``'s
    generator, optimizer and costs would not rebuild), projected as :func:`project` projects ``v``;
    ``max_activations`` is the budget that order was made within, if any, to report it."""
    return _measured(v, sched, placement.plan(sched, v.overlap, v.auto_layout), max_activations, False)


def _measured(v: Variant, sched: Schedule, plan: Plan, budget: int | None, clamped: bool) -> Projection:
    """Simulate ``sched``'s order under ``plan``'s costs; its peaks, parameters and exposed all-to-all."""
    res = simulate(sched, plan.costs)
    peak = max(weighted_peak(ops, plan.activations) for ops in sched.ops)
    params = max(sum((plan.params[k] for k in sched.stages_on(r)), Fraction(0))
                 for r in range(sched.ranks))
    exposed = (max(sum(plan.exposed(op) for op in ops) for ops in sched.ops)
               if plan.exposed else None)
    live = max(peak_live_activations(ops) for ops in sched.ops)
    return Projection(v, res, peak, params, exposed, plan.layout, live, budget, clamped, sched)


__all__ = ["Projection", "VARIANTS", "Variant", "activation_budget", "build_variant",
           "megatron_combined_1f1b", "project", "project_order", "variants"]
