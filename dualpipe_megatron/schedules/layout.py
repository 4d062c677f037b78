"""Layers per stage for DualPipe/DualPipeV: a per-layer cost model and a search over splits.

Real stages are not equal: the first holds the embedding, the last the output layer, the loss
and the MTP layers (under DualPipeV both on rank 0), and dense and MoE layers differ. An even
split of ``--num-layers`` leaves those differences to the bubbles; :func:`best_layout` instead
picks the contiguous split whose step, simulated with per-stage costs
(:class:`~.simulate.StageCosts`), is shortest, as a Megatron layout string for
``--dualpipe-layout``. For Megatron's own schedules (the projection's ``auto`` rows) the search
also knows the layouts that only Megatron runs: the loss as a stage of its own after the MTP
layers' (its ``mtp_standalone``) and the embedding alone. Pure Python: no torch, no Megatron.

Costs are per micro-batch, in any unit: FLOPs from the model's shape
(:meth:`LayerCosts.from_shape`, counted as :mod:`.model_shape` documents: causal attention is
the half of the square under the mask) or per-layer figures from a JSON file
(:meth:`LayerCosts.from_json_obj`, e.g. measured).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, NamedTuple, Sequence

from .events import Encoder, Replay, TimedOp
from .ir import Op, Schedule, ScheduleError, halves
from .model_shape import ModelShape, cost_of, total
from .registry import build_schedule
from .simulate import STAGE_FIELDS, Number, StageCost, StageCosts, exact, simulate
from .validate import validate

SCHEDULES = ("dualpipev", "dualpipe")


@dataclass(frozen=True)
class LayerCosts:
    """One micro-batch's costs of every layer in model order: what a stage's cost sums.

    File form (``--layer-costs``): ``{"embedding": {"F", "B", "W"}, "decoder": [{"F", "B", "W"},
    ...], "mtp": [...], "loss": {"F", "B", "W"}}``; ``loss`` is the output layer and the loss.
    """

    embedding: StageCost
    decoder: tuple[StageCost, ...]
    loss: StageCost
    mtp: tuple[StageCost, ...] = ()

    def __post_init__(self) -> None:
        if not self.decoder:
            raise ScheduleError("layer costs: no decoder layers")
        named = [("embedding", self.embedding), ("loss", self.loss)]
        named += [(f"decoder[{i}]", c) for i, c in enumerate(self.decoder)]
        named += [(f"mtp[{i}]", c) for i, c in enumerate(self.mtp)]
        for name, c in named:
            if not (c.F >= 0 and c.B >= c.W >= 0):
                raise ScheduleError(f"layer costs: {name} needs F >= 0 and B >= W >= 0")
            if name.startswith(("decoder", "mtp")) and not (c.F > 0 and c.B > c.W):
                raise ScheduleError(f"layer costs: {name} needs F > 0 and B > W")

    @classmethod
    def from_shape(cls, shape: ModelShape) -> "LayerCosts":
        """FLOPs of ``shape``'s layers (B = 2F, W = the weight matmuls' F); MTP layers are built
        like the last decoder layer."""
        moe = shape.moe_layers()
        return cls(shape.embedding(), tuple(shape.decoder(m) for m in moe), shape.output_and_loss(),
                   tuple(shape.mtp(moe[-1]) for _ in range(shape.mtp_layers)))

    @classmethod
    def from_json_obj(cls, obj: Any) -> "LayerCosts":
        def one(entry: Any, name: str) -> StageCost:
            try:
                return cost_of(entry["F"], entry["B"], entry["W"])
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                raise ScheduleError(f"layer costs: bad {name} {entry!r} ({exc})") from None

        if not isinstance(obj, dict) or not isinstance(obj.get("decoder"), list):
            raise ScheduleError('layer costs: expected {"embedding": {"F", "B", "W"}, "decoder": '
                                '[{"F", "B", "W"}, ...], "mtp": [...], "loss": {"F", "B", "W"}}')
        if not isinstance(obj.get("mtp", []), list):
            raise ScheduleError("layer costs: mtp must be a list")
        return cls(one(obj.get("embedding"), "embedding"),
                   tuple(one(e, f"decoder[{i}]") for i, e in enumerate(obj["decoder"])),
                   one(obj.get("loss"), "loss"),
                   tuple(one(e, f"mtp[{i}]") for i, e in enumerate(obj.get("mtp", []))))

    def to_json_obj(self) -> dict:
        def one(c: StageCost) -> dict:
            return {"F": float(c.F), "B": float(c.B), "W": float(c.W)}

        return {"embedding": one(self.embedding), "decoder": [one(c) for c in self.decoder],
                "mtp": [one(c) for c in self.mtp], "loss": one(self.loss)}

    @property
    def num_layers(self) -> int:
        return len(self.decoder)

    def fixed_parts(self, stages: int, loss_alone: bool = False) -> list[list[StageCost]]:
        """What each of ``stages`` stages holds besides decoder layers: the embedding opens the
        first; the MTP layers and the loss close the last, or with ``loss_alone`` the MTP layers
        close the last but one and the loss is the last stage alone. That stage then also runs
        each MTP layer's output layer and loss (Megatron's post-process computes them from the
        hidden states the MTP stage hands on), so an MTP layer there costs its entry less
        ``loss``: each entry includes a head like ``loss`` (:meth:`from_shape`'s do)."""
        parts: list[list[StageCost]] = [[] for _ in range(stages)]
        parts[0].append(self.embedding)
        if not loss_alone:
            parts[-1] += [*self.mtp, self.loss]
            return parts
        if stages < 2:
            raise ScheduleError("the loss alone needs two stages or more")
        parts[-2] += [self._without_head(i) for i in range(len(self.mtp))]
        parts[-1] += [self.loss] * (1 + len(self.mtp))
        return parts

    def _without_head(self, i: int) -> StageCost:
        """MTP layer ``i`` less its output layer and loss, which run on the loss's stage."""
        body = self.mtp[i] + self.loss * -1
        if min(getattr(body, f) for f in STAGE_FIELDS) < 0 or body.B < body.W:
            raise ScheduleError(f"layer costs: mtp[{i}] must include an output layer and loss like "
                                "'loss' to stand apart from it")
        return body

    def stage_cost(self, counts: Sequence[int], stage: int, loss_alone: bool = False) -> StageCost:
        """Cost of ``stage`` when stage i holds ``counts[i]`` consecutive decoder layers and
        :meth:`fixed_parts`' share."""
        start = sum(counts[:stage])
        return total([*self.decoder[start:start + counts[stage]],
                      *self.fixed_parts(len(counts), loss_alone)[stage]])


class Split(NamedTuple):
    """A layout as the search sees it: decoder layers per stage in model order, and whether the
    loss is a stage of its own (``counts[-1] == 0``; the MTP layers then close the stage before)."""

    counts: tuple[int, ...]
    loss_alone: bool = False


def parse_moe_layer_freq(text: str) -> int | tuple[int, ...]:
    """Megatron's ``--moe-layer-freq``: ``N`` or a list expression such as ``([0]*3+[1]*58)``,
    evaluated without ``eval``."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(e) for e in node.elts]
            if all(type(v) is int for v in items):
                return items
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
                items, times = (left, right) if isinstance(left, list) else (right, left)
                if len(items) * times > 100_000:
                    raise ValueError("pattern too long")
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(f"unsupported {type(node).__name__}")

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
        if isinstance(result, list):
            return tuple(result)
        if type(result) is int:
            return result
        raise ValueError("not a list or an integer")
    except (SyntaxError, TypeError, ValueError) as exc:
        raise ScheduleError(f"--moe-layer-freq {text!r}: expected N or a list expression like "
                            f"'([0]*3+[1]*58)' ({exc})") from None


def layout_string(counts: Sequence[int], mtp_layers: int = 0, loss_alone: bool = False) -> str:
    """Megatron's layout string for decoder-layer ``counts`` per stage, in model-stage order; the
    MTP layers close the last stage with the loss or, with ``loss_alone``, the one before it."""
    last = len(counts) - 1
    return "|".join(("E" if s == 0 else "") + "t" * n + ("m" * mtp_layers if s == last - loss_alone else "")
                    + ("L" if s == last else "") for s, n in enumerate(counts))


def even_counts(num_layers: int, stages: int) -> list[int]:
    """Megatron's even split; when it does not divide, the extra layers go to the middle stages
    (away from the embedding and the loss)."""
    if num_layers < stages:
        raise ScheduleError(f"{num_layers} decoder layers cannot give each of the {stages} stages one")
    counts = [num_layers // stages] * stages
    middle = sorted(range(stages), key=lambda s: (abs(2 * s - (stages - 1)), s))
    for s in middle[:num_layers % stages]:
        counts[s] += 1
    return counts


def stage_costs_for(sched: Schedule, layer_costs: LayerCosts, counts: Sequence[int],
                    fb_ratio: Number = 1, c: Number = 0, loss_alone: bool = False) -> StageCosts:
    """Per-(direction, stage) costs of the split ``counts`` (the same split in both DualPipe
    directions); ``loss_alone``: the loss is the last stage alone (:meth:`LayerCosts.fixed_parts`)."""
    if len(counts) != sched.stages or sum(counts) != layer_costs.num_layers:
        raise ScheduleError(f"a split of {sum(counts)} layers over {len(counts)} stages for "
                            f"{layer_costs.num_layers} layers over {sched.stages}")
    if loss_alone and counts[-1]:
        raise ScheduleError(f"the loss alone in the last stage, yet {counts[-1]} decoder layers there")
    per_stage = [layer_costs.stage_cost(counts, s, loss_alone) for s in range(sched.stages)]
    return StageCosts({(d, s): per_stage[s] for d, s in sched.placement}, exact(fb_ratio), exact(c))


class _Timer:
    """The makespan :func:`simulate` gives one schedule, for many splits.

    ``simulate`` validates the schedule and encodes its ops on every call and times in
    fractions; a search times thousands of splits. This does both once and times in integers
    with the events core's :class:`~.events.Replay`: costs come scaled to integers (the p2p
    latency ``c`` too), and each op's duration, linear in its stages' F, B and W, has its
    coefficients read off :meth:`StageCosts.duration` once (times ``fb_ratio``'s denominator,
    which makes them whole), so the cost rules stay the simulator's. An op's cost index is its
    shape (kind and stages): a split gives one duration per shape. Tests hold the result
    equal to ``simulate``'s.
    """

    def __init__(self, sched: Schedule, fb_ratio: Fraction, c: int) -> None:
        validate(sched)
        self.sched = sched
        self.scale = fb_ratio.denominator
        encoder = Encoder(sched)
        shapes: dict[tuple, int] = {}
        self.terms: list[list[tuple[int, ...]]] = []  # per shape: (stage, F/B/W, coefficient)
        lists: list[list[TimedOp]] = []
        for ops in sched.ops:
            row = []
            for op in ops:
                shape = tuple((type(h).__name__, h.key.d, h.key.s, getattr(h, "w", True)) for h in halves(op))
                if shape not in shapes:
                    shapes[shape] = len(self.terms)
                    self.terms.append(self._coefficients(op, fb_ratio, self.scale))
                row.append(encoder.encode(op, shapes[shape], c))
            lists.append(row)
        self.replay = Replay(lists, encoder.size)
        # Each rank's total op time, linear in its stages' costs too: {(stage, F/B/W): coefficient}.
        self.per_rank: list[dict[tuple[int, int], int]] = [{} for _ in range(sched.ranks)]
        for rank, row in enumerate(lists):
            for o in row:
                for s, i, coef in self.terms[o.cost]:
                    self.per_rank[rank][(s, i)] = self.per_rank[rank].get((s, i), 0) + coef

    @staticmethod
    def _coefficients(op: Op, fb_ratio: Fraction, scale: int) -> list[tuple[int, ...]]:
        stages = {(h.key.d, h.key.s) for h in halves(op)}
        zero = StageCost(Fraction(0), Fraction(0), Fraction(0))
        terms = []
        for d, s in sorted(stages):
            for i in range(len(STAGE_FIELDS)):
                unit = StageCost(*(Fraction(i == j) for j in range(len(STAGE_FIELDS))))
                coef = StageCosts({**{k: zero for k in stages}, (d, s): unit}, fb_ratio).duration(op)
                if coef:
                    whole = coef * scale
                    if whole.denominator != 1:
                        raise AssertionError(f"coefficient {coef} of {op} is not whole times {scale}")
                    terms.append((s, i, int(whole)))
        return terms

    def durations(self, stage_costs: list[tuple[int, ...]]) -> list[int]:
        """Op durations per shape, times ``scale``, from per-stage integer (F, B, W)."""
        return [sum(coef * stage_costs[s][i] for s, i, coef in terms) for terms in self.terms]

    def busy(self, stage_costs: list[tuple[int, ...]]) -> list[int]:
        """Each rank's total op time, times ``scale``: no step is shorter than any of them."""
        return [sum(coef * stage_costs[s][i] for (s, i), coef in row.items()) for row in self.per_rank]

    def makespan(self, durations: list[int]) -> int:
        return self.replay.makespan(durations)


class _Search:
    """Steepest descent over splits: each step moves one decoder layer between two stages.

    ``megatron``: the layouts Megatron's ``--pipeline-model-parallel-layout`` accepts, so splits
    with the loss as a stage of its own (:class:`Split`) too, and the first stage may hold the
    embedding alone; otherwise the layouts our runtime accepts
    (:func:`~..megatron.topology.layout_problems`: the MTP layers and the loss share the last).
    """

    def __init__(self, sched: Schedule, layer_costs: LayerCosts, fb_ratio: Fraction, c: Fraction,
                 megatron: bool = False) -> None:
        lc = layer_costs
        parts = (lc.embedding, lc.loss, *lc.decoder, *lc.mtp)
        self.unit = unit = math.lcm(*(getattr(p, f).denominator for p in parts for f in STAGE_FIELDS),
                                    c.denominator)
        self.timer = _Timer(sched, fb_ratio, int(c * unit) * fb_ratio.denominator)

        def ints(cost: StageCost) -> tuple[int, ...]:
            return tuple(int(getattr(cost, f) * unit) for f in STAGE_FIELDS)

        self.tails = (False, True) if megatron and sched.stages > 1 else (False,)  # loss_alone values
        self.fixed = {alone: [ints(total(p)) for p in lc.fixed_parts(sched.stages, alone)] for alone in self.tails}
        self.floors = {alone: _floors(sched.stages, alone, bool(lc.mtp), megatron) for alone in self.tails}
        self.prefix: list[tuple[int, ...]] = [(0,) * len(STAGE_FIELDS)]
        for cost in lc.decoder:
            self.prefix.append(tuple(a + b for a, b in zip(self.prefix[-1], ints(cost))))
        self.seen: dict[Split, tuple] = {}

    def stage_costs(self, split: Split) -> list[tuple[int, ...]]:
        costs, start = [], 0
        for n, fixed in zip(split.counts, self.fixed[split.loss_alone]):
            lo, hi = self.prefix[start], self.prefix[start + n]
            costs.append(tuple(b - a + f for a, b, f in zip(lo, hi, fixed)))
            start += n
        return costs

    def key(self, split: Split) -> tuple:
        """Shortest step (in units of 1 / (``unit`` x ``timer.scale``)) first, then the more
        even split, then the order of the counts, then the loss with the MTP layers before the
        loss alone."""
        if split not in self.seen:
            step = self.timer.makespan(self.timer.durations(self.stage_costs(split)))
            self.seen[split] = (step, sum(n * n for n in split.counts), split)
        return self.seen[split]

    def moves(self, split: Split) -> list[tuple[int, int]]:
        """(from, to) stage pairs worth trying: neighbours, the two stages of one rank, from the
        busiest rank's stages and to the idlest rank's (all pairs would time S(S-1) splits per
        step for about the same result); never below a stage's floor nor into a loss alone."""
        counts, floors = split.counts, self.floors[split.loss_alone]
        busy = self.timer.busy(self.stage_costs(split))
        on_rank = [{s for _, s in self.timer.sched.stages_on(r)} for r in range(len(busy))]
        heavy, light = on_rank[busy.index(max(busy))], on_rank[busy.index(min(busy))]
        closed = len(counts) - 1 if split.loss_alone else None
        return [(a, b) for a in range(len(counts)) for b in range(len(counts))
                if a != b and b != closed and counts[a] > floors[a]
                and (abs(a - b) == 1 or a in heavy or b in light or any({a, b} <= r for r in on_rank))]

    def descend(self, start: Split) -> tuple:
        best = self.key(start)
        while True:
            current = best
            for a, b in self.moves(current[2]):
                cand = Split(tuple(n - (i == a) + (i == b) for i, n in enumerate(current[2].counts)),
                             start.loss_alone)
                if cand not in self.seen:
                    bound = max(self.timer.busy(self.stage_costs(cand)))
                    if (bound, sum(n * n for n in cand.counts), cand) >= best:
                        continue  # its step is at least its busiest rank's work
                best = min(best, self.key(cand))
            if best == current:
                return best


def _floors(stages: int, loss_alone: bool, mtp: bool, megatron: bool) -> tuple[int, ...]:
    """Fewest decoder layers per stage: one, except that a stage with the MTP layers may hold
    them alone (each is a transformer layer: DeepSeek-V3's ``mL``), Megatron's first stage may
    hold the embedding alone, and a loss alone holds none."""
    floors = [0 if megatron and s == 0 else 1 for s in range(stages)]
    if mtp:
        floors[-1 - loss_alone] = 0
    if loss_alone:
        floors[-1] = 0
    return tuple(floors)


def _balanced_counts(layer_costs: LayerCosts, floors: Sequence[int],
                     loss_alone: bool = False) -> tuple[int, ...] | None:
    """The split whose heaviest stage (F + B per micro-batch) is lightest, by dynamic programming
    over the first ``i`` layers in the first ``s + 1`` stages (stage ``s`` holding ``floors[s]``
    layers or more, a loss alone none); None when the floors need more layers than there are."""
    L, stages = layer_costs.num_layers, len(floors)
    prefix = [Fraction(0)]
    for cost in layer_costs.decoder:
        prefix.append(prefix[-1] + cost.F + cost.B)
    extra = [sum((c.F + c.B for c in parts), Fraction(0))
             for parts in layer_costs.fixed_parts(stages, loss_alone)]
    best: dict[int, tuple[Fraction, tuple[int, ...]]] = {0: (Fraction(0), ())}
    for s in range(stages):
        most = 0 if loss_alone and s == stages - 1 else L
        reach = {}
        for i in range(sum(floors[:s + 1]), L - sum(floors[s + 1:]) + 1):
            options = [(max(best[j][0], prefix[i] - prefix[j] + extra[s]), best[j][1] + (i - j,))
                       for j in best if floors[s] <= i - j <= most]
            if options:
                reach[i] = min(options)
        best = reach
    return best[L][1] if L in best else None


def best_counts(sched: Schedule, layer_costs: LayerCosts, fb_ratio: Fraction, c: Fraction,
                megatron: bool = False) -> Split:
    """The split of ``sched``'s stages (any schedule: its stages in model order) with the
    shortest simulated step; the search of :func:`best_layout`. ``megatron``: among the layouts
    Megatron accepts (:class:`_Search`), the loss alone too. Each kind of tail starts from the
    even split (where every stage can hold a layer) and from the one with the lightest heaviest
    stage (where the floors fit)."""
    search = _Search(sched, layer_costs, fb_ratio, c, megatron)
    L, found = layer_costs.num_layers, []
    for alone in search.tails:
        open_stages = sched.stages - alone
        if L >= open_stages:
            found.append(search.descend(Split(tuple(even_counts(L, open_stages)) + (0,) * alone, alone)))
        balanced = _balanced_counts(layer_costs, search.floors[alone], alone)
        if balanced is not None:
            found.append(search.descend(Split(balanced, alone)))
    if not found:
        raise ScheduleError(f"{L} decoder layers cannot give each of the {sched.stages} stages one")
    return min(found)[2]


def best_layout(schedule: str, ranks: int, microbatches: int, layer_costs: LayerCosts,
                fb_ratio: Number = 1, c: Number = 0) -> tuple[str, StageCosts, Fraction]:
    """The split of ``layer_costs``' decoder layers with the shortest simulated step of
    ``schedule`` at ``microbatches``; ties go to the more even split, then to the smaller
    counts in stage order, so the answer is deterministic.

    Layers stay in model order; the embedding opens the first stage, the MTP layers and the loss
    close the last; every stage holds one decoder layer or more, except that a last stage with
    MTP layers may hold none (each MTP layer is a transformer layer: DeepSeek-V3's ``mL``).
    Starts from the even split and from the split with the lightest heaviest stage and moves
    one layer at a time (see :meth:`_Search.moves`) while the step shortens. Returns the layout
    string, its stage costs and the step as :func:`simulate` times it.
    """
    if schedule not in SCHEDULES:
        raise ScheduleError(f"layout search is for {' and '.join(SCHEDULES)}, not {schedule!r}")
    try:
        ratio, latency = exact(fb_ratio), exact(c)
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise ScheduleError(f"bad fb_ratio or c: {exc}") from None
    if ratio <= 0 or latency < 0:
        raise ScheduleError(f"fb_ratio must be > 0 and c >= 0, got {fb_ratio} and {c}")
    sched = build_schedule(schedule, ranks, microbatches)
    counts = best_counts(sched, layer_costs, ratio, latency).counts
    costs = stage_costs_for(sched, layer_costs, counts, ratio, latency)
    return layout_string(counts, len(layer_costs.mtp)), costs, simulate(sched, costs).makespan


__all__ = ["LayerCosts", "SCHEDULES", "Split", "best_counts", "best_layout", "even_counts", "layout_string",
           "parse_moe_layer_freq", "stage_costs_for"]
