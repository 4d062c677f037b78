"""Layers per stage for DualPipe/DualPipeV: a per-layer cost model and a search over splits.

Real stages are not equal: the first holds the embedding, the last the output layer, the loss
and the MTP layers (under DualPipeV both on rank 0), and dense and MoE layers differ. An even
split of ``--num-layers`` leaves those differences to the bubbles; :func:`best_layout` instead
picks the contiguous split whose step, simulated with per-stage costs
(:class:`~.simulate.StageCosts`), is shortest, as a Megatron layout string for
``--dualpipe-layout``. Pure Python: no torch, no Megatron.

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
from typing import Any, Sequence

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

    def stage_cost(self, counts: Sequence[int], stage: int) -> StageCost:
        """Cost of ``stage`` when stage i holds ``counts[i]`` consecutive decoder layers."""
        start = sum(counts[:stage])
        parts = list(self.decoder[start:start + counts[stage]])
        if stage == 0:
            parts.insert(0, self.embedding)
        if stage == len(counts) - 1:
            parts += [*self.mtp, self.loss]
        return total(parts)


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


def layout_string(counts: Sequence[int], mtp_layers: int = 0) -> str:
    """Megatron's layout string for decoder-layer ``counts`` per stage, in model-stage order."""
    last = len(counts) - 1
    return "|".join(("E" if s == 0 else "") + "t" * n + ("m" * mtp_layers + "L" if s == last else "")
                    for s, n in enumerate(counts))


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
                    fb_ratio: Number = 1, c: Number = 0) -> StageCosts:
    """Per-(direction, stage) costs of the split ``counts`` (the same split in both DualPipe directions)."""
    if len(counts) != sched.stages or sum(counts) != layer_costs.num_layers:
        raise ScheduleError(f"a split of {sum(counts)} layers over {len(counts)} stages for "
                            f"{layer_costs.num_layers} layers over {sched.stages}")
    per_stage = [layer_costs.stage_cost(counts, s) for s in range(sched.stages)]
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
    """Steepest descent over splits: each step moves one decoder layer between two stages."""

    def __init__(self, sched: Schedule, layer_costs: LayerCosts, fb_ratio: Fraction, c: Fraction) -> None:
        lc = layer_costs
        parts = (lc.embedding, lc.loss, *lc.decoder, *lc.mtp)
        self.unit = unit = math.lcm(*(getattr(p, f).denominator for p in parts for f in STAGE_FIELDS),
                                    c.denominator)
        self.timer = _Timer(sched, fb_ratio, int(c * unit) * fb_ratio.denominator)

        def ints(cost: StageCost) -> tuple[int, ...]:
            return tuple(int(getattr(cost, f) * unit) for f in STAGE_FIELDS)

        self.head = ints(lc.embedding)
        self.tail = ints(total([*lc.mtp, lc.loss]))
        self.prefix: list[tuple[int, ...]] = [(0,) * len(STAGE_FIELDS)]
        for cost in lc.decoder:
            self.prefix.append(tuple(a + b for a, b in zip(self.prefix[-1], ints(cost))))
        self.min_last = 0 if lc.mtp else 1
        self.seen: dict[tuple[int, ...], tuple] = {}

    def stage_costs(self, counts: tuple[int, ...]) -> list[tuple[int, ...]]:
        costs, start = [], 0
        for s, n in enumerate(counts):
            lo, hi = self.prefix[start], self.prefix[start + n]
            cost = [b - a for a, b in zip(lo, hi)]
            if s == 0:
                cost = [a + b for a, b in zip(cost, self.head)]
            if s == len(counts) - 1:
                cost = [a + b for a, b in zip(cost, self.tail)]
            costs.append(tuple(cost))
            start += n
        return costs

    def key(self, counts: tuple[int, ...]) -> tuple:
        """Shortest step (in units of 1 / (``unit`` x ``timer.scale``)) first, then the more
        even split, then the order of the counts."""
        if counts not in self.seen:
            step = self.timer.makespan(self.timer.durations(self.stage_costs(counts)))
            self.seen[counts] = (step, sum(n * n for n in counts), counts)
        return self.seen[counts]

    def moves(self, counts: tuple[int, ...]) -> list[tuple[int, int]]:
        """(from, to) stage pairs worth trying: neighbours, the two stages of one rank, from the
        busiest rank's stages and to the idlest rank's (all pairs would time S(S-1) splits per
        step for about the same result)."""
        busy = self.timer.busy(self.stage_costs(counts))
        on_rank = [{s for _, s in self.timer.sched.stages_on(r)} for r in range(len(busy))]
        heavy, light = on_rank[busy.index(max(busy))], on_rank[busy.index(min(busy))]
        last = len(counts) - 1
        return [(a, b) for a in range(len(counts)) for b in range(len(counts))
                if a != b and counts[a] > (self.min_last if a == last else 1)
                and (abs(a - b) == 1 or a in heavy or b in light or any({a, b} <= r for r in on_rank))]

    def descend(self, start: tuple[int, ...]) -> tuple:
        best = self.key(start)
        while True:
            current = best
            for a, b in self.moves(current[2]):
                cand = tuple(n - (i == a) + (i == b) for i, n in enumerate(current[2]))
                if cand not in self.seen:
                    bound = max(self.timer.busy(self.stage_costs(cand)))
                    if (bound, sum(n * n for n in cand), cand) >= best:
                        continue  # its step is at least its busiest rank's work
                best = min(best, self.key(cand))
            if best == current:
                return best


def _balanced_counts(layer_costs: LayerCosts, stages: int) -> tuple[int, ...]:
    """The split whose heaviest stage (F + B per micro-batch) is lightest, by dynamic programming
    over the first ``i`` layers in the first ``s + 1`` stages (each stage one layer or more)."""
    L = layer_costs.num_layers
    prefix = [Fraction(0)]
    for cost in layer_costs.decoder:
        prefix.append(prefix[-1] + cost.F + cost.B)
    head = layer_costs.embedding.F + layer_costs.embedding.B
    tail = sum((c.F + c.B for c in (*layer_costs.mtp, layer_costs.loss)), Fraction(0))
    best = {i: (head + prefix[i], (i,)) for i in range(1, L - stages + 2)}
    for s in range(1, stages):
        extra = tail if s == stages - 1 else 0
        best = {i: min((max(best[j][0], prefix[i] - prefix[j] + extra), best[j][1] + (i - j,))
                       for j in range(s, i))
                for i in range(s + 1, L - (stages - 1 - s) + 1)}
    return best[L][1]


def best_counts(sched: Schedule, layer_costs: LayerCosts, fb_ratio: Fraction, c: Fraction) -> tuple[int, ...]:
    """Decoder layers per stage of ``sched`` (any schedule: its stages in model order) with the
    shortest simulated step; the search of :func:`best_layout`."""
    search = _Search(sched, layer_costs, fb_ratio, c)
    even = tuple(even_counts(layer_costs.num_layers, sched.stages))
    return min(search.descend(even), search.descend(_balanced_counts(layer_costs, sched.stages)))[2]


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
    counts = best_counts(sched, layer_costs, ratio, latency)
    costs = stage_costs_for(sched, layer_costs, counts, ratio, latency)
    return layout_string(counts, len(layer_costs.mtp)), costs, simulate(sched, costs).makespan


__all__ = ["LayerCosts", "SCHEDULES", "best_counts", "best_layout", "even_counts", "layout_string",
           "parse_moe_layer_freq", "stage_costs_for"]
