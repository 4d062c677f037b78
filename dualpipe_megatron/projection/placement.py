"""Where the model's layers sit, and what each schedule's stages then cost.

Three placements feed :func:`~.project.project`:

- :class:`Uniform`: every stage is an equal share of ``P`` stages of MoE layers (the
  embedding, the output layer and loss, the dense layers and MTP left out).
- :class:`FromFile`: a stage-cost file (the simulator's ``--stage-costs`` JSON) gives
  direction 0's stages in model order; a schedule with ``k`` times as many stages cuts each
  into ``k`` equal parts.
- :class:`Realistic`: the whole model, layer by layer: the embedding opens the first stage,
  dense layers come first, the output layer, loss and MTP close the last stage. Per-layer
  costs are one MoE layer's projected ms scaled op by op by the FLOP ratio to a MoE layer
  (:mod:`..schedules.model_shape`'s FLOP count, the one the stages' costs use); all-to-all
  only on MoE layers. Megatron's
  schedules get the split of ``--account-for-embedding-in-pipeline-split
  --account-for-loss-in-pipeline-split`` (embedding and loss count as one layer each);
  ``auto`` rows the layout search (:func:`~..schedules.layout.best_counts`): for Megatron's
  schedules over layouts its ``--pipeline-model-parallel-layout`` takes (the loss alone in the
  last stage too), for DualPipe(V) over those our runtime takes.

Activations and parameters are in units of one uniform 1/P stage (``layers_per_rank`` MoE
layers), so the columns stay comparable across placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Protocol

from ..schedules.ir import FB, B, F, Op, Schedule, ScheduleError, W, halves
from ..schedules.layout import LayerCosts, Split, best_counts, even_counts, layout_string, stage_costs_for
from ..schedules.model_shape import ModelShape
from ..schedules.simulate import AnyCosts, StageCost, StageCosts
from .costs import StageTimes, exposed_a2a, microseconds, schedule_costs
from .count import ChunkCount
from .shapes import ProjectionError

LOGIT_BYTES = 4  # the loss keeps fp32 logits for its backward
MEGATRON_SCHEDULES = ("1f1b", "interleaved")  # run by Megatron's own pipeline


@dataclass(frozen=True)
class Plan:
    """One schedule's stages as the projection times and weighs them."""

    costs: AnyCosts
    activations: dict[tuple[int, int], Fraction]  # per (direction, stage), in 1/P stages
    params: dict[tuple[int, int], Fraction]  # per (direction, stage), in 1/P stages
    exposed: Callable[[Op], float] | None  # ms of all-to-all an op leaves exposed
    layout: str | None = None


class Placement(Protocol):
    def plan(self, sched: Schedule, overlap: bool, auto_layout: bool) -> Plan: ...


def _fraction_of_model(sched: Schedule, ranks: int) -> dict[tuple[int, int], Fraction]:
    return dict.fromkeys(sched.placement, Fraction(ranks, sched.stages))


@dataclass(frozen=True)
class Uniform:
    """Equal stages: ``times`` is one 1/P stage; a schedule with more stages scales it down."""

    times: StageTimes
    loss: float
    ranks: int

    def plan(self, sched: Schedule, overlap: bool, auto_layout: bool) -> Plan:
        share = Fraction(self.ranks, sched.stages)
        costs = schedule_costs(self.times, overlap, self.loss).scaled(share)
        whole = _fraction_of_model(sched, self.ranks)
        return Plan(costs, whole, whole,
                    lambda op: exposed_a2a(op, self.times, self.loss) * float(share))


@dataclass(frozen=True)
class FromFile:
    """Direction 0's stages of a stage-cost file, in model order, cut evenly per schedule."""

    costs: StageCosts
    ranks: int

    def __post_init__(self) -> None:
        n = len(self.costs.stages)
        if set(self.costs.stages) != {(0, s) for s in range(n)}:
            raise ProjectionError("--stage-costs: give direction 0's stages 0..N-1 (one model copy "
                                  "in model order); each schedule cuts them to its own stages")

    def plan(self, sched: Schedule, overlap: bool, auto_layout: bool) -> Plan:
        n = len(self.costs.stages)
        if sched.stages % n:
            raise ScheduleError(f"{sched.name}: its {sched.stages} stages do not cut the file's {n} evenly")
        k = sched.stages // n
        costs = StageCosts({(d, s): self.costs.stages[(0, s // k)] * Fraction(1, k)
                            for d, s in sched.placement}, self.costs.fb_ratio, self.costs.c)
        whole = _fraction_of_model(sched, self.ranks)
        return Plan(costs, whole, whole, None)


def _digits4(value: float) -> Fraction:
    return Fraction(round(value * 10000), 10000)


def megatron_counts(num_layers: int, stages: int) -> list[int]:
    """Decoder layers per stage under ``--account-for-embedding/loss-in-pipeline-split``: the
    embedding and the loss count as one layer each. Megatron asks ``num_layers + 2`` to divide
    by the stages; when it does not, the extra layers go to the middle stages (as an uneven
    ``--pipeline-model-parallel-layout`` would put them)."""
    if num_layers + 2 < stages:
        raise ScheduleError(f"{num_layers} layers + embedding + loss cannot fill {stages} stages")
    counts = even_counts(num_layers + 2, stages)
    counts[0] -= 1
    counts[-1] -= 1
    return counts


@dataclass(frozen=True)
class PairCosts(StageCosts):
    """Stage costs whose F&B pairs are timed pair by pair, with each stage's all-to-all known.

    A stage's ``F`` and ``B`` include its all-to-all (``comm``: the F's, the B's). A pair
    of F on stage f and B on stage b computes ``C = fb_ratio * (compute of F_f + B_b)``
    (less ``W_b`` when its weight grad is deferred) while ``A`` = the two all-to-alls
    run beside it, and costs ``max(C, A) + loss * min(C, A)``: whichever is longer, plus
    ``loss`` of the shorter. ``Fo``/``Bo`` = ``(fb_ratio - loss) x`` the stage's all-to-all
    make the simulator's linear rule equal to this wherever ``C >= A``; the layout
    search and the op-order optimizer use that linear rule, every simulated step this one.
    """

    comm: dict[tuple[int, int], tuple[Fraction, Fraction]] = field(default_factory=dict)
    loss: Fraction = Fraction(0)

    def pair(self, op: FB) -> tuple[Fraction, Fraction]:
        """(compute, all-to-all) of one pair."""
        f, b = (op.f.key.d, op.f.key.s), (op.b.key.d, op.b.key.s)
        af, ab = self.comm[f][0], self.comm[b][1]
        cf, cb = self.stages[f], self.stages[b]
        compute = self.fb_ratio * (cf.F - af + cb.B - ab) - (0 if op.b.w else cb.W)
        return compute, af + ab

    def duration(self, op: Op) -> Fraction:
        if not isinstance(op, FB):
            return super().duration(op)
        compute, comm = self.pair(op)
        return max(compute, comm) + self.loss * min(compute, comm)

    def exposed(self, op: Op) -> float:
        """ms of all-to-all the op leaves on its rank's critical path."""
        if isinstance(op, FB):
            return float(self.duration(op) - self.pair(op)[0])
        if isinstance(op, W):
            return 0.0
        return float(self.comm[(op.key.d, op.key.s)][0 if isinstance(op, F) else 1])


class Realistic:
    """The whole ``model`` placed layer by layer (see the module docstring); ``target`` is its
    1/P stage of MoE layers (:func:`~.shapes.stage_shape`), which ``times`` and ``chunk`` are of."""

    def __init__(self, model: ModelShape, target: ModelShape, times: StageTimes, chunk: ChunkCount,
                 loss: float, ranks: int, microbatches: int) -> None:
        self.model, self.ranks, self.microbatches = model, ranks, microbatches
        flops = LayerCosts.from_shape(model)
        moe = model.decoder(True)
        per = target.num_layers
        # An F-then-B pair's compute / lone compute (a second stream overlaps W): the pair rule's
        # fb_ratio; it and the loss to 4 digits, so the layout search's integer timer stays small.
        self.fb_ratio = _digits4(times.FB / (times.F + times.B))
        self.loss = _digits4(loss)
        hide = self.fb_ratio - self.loss
        a2a = (times.a2a_fwd / per, times.a2a_bwd / per)  # one MoE layer, each way
        rate = {op: getattr(times, op) / per / float(getattr(moe, op)) for op in ("F", "B", "W")}

        def ms(c: StageCost, comm: bool) -> StageCost:
            af, ab = (microseconds(a) if comm else Fraction(0) for a in a2a)
            return StageCost(microseconds(float(c.F) * rate["F"]) + af,
                             microseconds(float(c.B) * rate["B"]) + ab,
                             microseconds(float(c.W) * rate["W"]), hide * af, hide * ab)

        moe_layers = model.moe_layers()
        self.a2a = tuple(microseconds(a) for a in a2a)
        self.layers = LayerCosts(ms(flops.embedding, False),
                                 tuple(ms(c, m) for c, m in zip(flops.decoder, moe_layers)),
                                 ms(flops.loss, False),
                                 tuple(ms(c, moe_layers[-1]) for c in flops.mtp))
        self.moe_layers = moe_layers
        self.mtp_moe = moe_layers[-1]
        layer = Fraction(1, per)  # one transformer layer, in 1/P stages (activations and params)
        self.layer_unit = layer
        self.logits = Fraction(target.tokens * model.vocab * LOGIT_BYTES, chunk.saved_bytes)
        self.table = Fraction(model.vocab * target.hidden, chunk.params)  # embedding or output weights
        self.p2p = microseconds(times.p2p)

    def counts(self, sched: Schedule, auto_layout: bool) -> list[int]:
        """Decoder layers per stage of a row without the layout search (``auto_layout`` False; MTP
        and loss on the last stage): Megatron's split. A subclass may give a job's own."""
        return megatron_counts(self.model.num_layers, sched.stages)

    def split(self, sched: Schedule, auto_layout: bool) -> Split:
        """The layout :meth:`plan` costs: the layout search's for ``auto_layout`` (for Megatron's
        schedules the loss alone too), else :meth:`counts`."""
        if auto_layout:
            return best_counts(sched, self.layers, self.fb_ratio, self.p2p, runs_on_megatron(sched))
        return Split(tuple(self.counts(sched, auto_layout)))

    def plan(self, sched: Schedule, overlap: bool, auto_layout: bool) -> Plan:
        counts, loss_alone = self.split(sched, auto_layout)
        linear = stage_costs_for(sched, self.layers, counts, self.fb_ratio, self.p2p, loss_alone)
        last = len(counts) - 1
        act, params, comm = {}, {}, {}
        for d, s in sched.placement:
            start = sum(counts[:s])
            mtp = self.model.mtp_layers if s == last - loss_alone else 0
            moe = sum(self.moe_layers[start:start + counts[s]]) + mtp * self.mtp_moe
            layers = counts[s] + mtp
            act[(d, s)] = layers * self.layer_unit + (self.logits * (1 + self.model.mtp_layers) if s == last else 0)
            params[(d, s)] = layers * self.layer_unit + self.table * ((s == 0) + (s == last))
            comm[(d, s)] = (moe * self.a2a[0], moe * self.a2a[1])
        costs = PairCosts(linear.stages, linear.fb_ratio, linear.c, comm, self.loss if overlap else Fraction(1))
        return Plan(costs, act, params, costs.exposed, layout_string(counts, self.model.mtp_layers, loss_alone))


def runs_on_megatron(sched: Schedule) -> bool:
    """Megatron's own pipeline runs ``sched`` (1F1B, interleaved, either with its all-to-all
    overlap: :func:`~.project.megatron_combined_1f1b`'s ``+a2a``), so its layout may be any that
    ``--pipeline-model-parallel-layout`` accepts, the loss alone in the last stage included."""
    return sched.name.split("+")[0] in MEGATRON_SCHEDULES


def weighted_peak(ops: list[Op], weight: dict[tuple[int, int], Fraction]) -> Fraction:
    """Peak of live activations on a rank, each (d, s, m) weighing its stage's activations."""
    live = peak = Fraction(0)
    for op in ops:
        for h in halves(op):
            if isinstance(h, F):
                live += weight[(h.key.d, h.key.s)]
        peak = max(peak, live)
        for h in halves(op):
            if isinstance(h, W) or (isinstance(h, B) and h.w):
                live -= weight[(h.key.d, h.key.s)]
    return peak


__all__ = ["FromFile", "PairCosts", "Placement", "Plan", "Realistic", "Uniform", "megatron_counts",
           "runs_on_megatron", "weighted_peak"]
