"""Per-rank F&B pairing policies for the list scheduler under an activation budget
(:mod:`.optimize`): which of a rank's (F stage, B stage) combinations it runs as one F&B pair
when both are ready, found by coordinate descent over whole list schedules.

Why: a pair's outputs leave only when it ends, so a pair slows the hops of a micro-batch's
round trip and keeps activations live longer. Under a budget, which caps the micro-batches in
flight, pairing everywhere starves the pipeline and pairing nowhere forgoes what pairs save.
Which ranks and combinations gain depends on the placement and the costs, so it is searched."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

from .ir import Op
from .list_scheduler import PairPolicy, Rule, Stage, list_schedule
from .order_model import INF, OrderModel

SWEEPS = 2  # passes over the ranks at most
Run = Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]]  # maps a function over tasks, as Workers.map


def policies(model: OrderModel, r: int) -> list[frozenset[tuple[Stage, Stage]]]:
    """Rank r's candidate policies over its combinations that a pair shortens: every set of
    them when there are at most four (a rank with two stages), else none, each alone, and all."""
    combos = model.saving_pairs[r]
    if len(combos) <= 4:
        return [frozenset(c for i, c in enumerate(combos) if bits >> i & 1) for bits in range(1 << len(combos))]
    return [frozenset()] + [frozenset([c]) for c in combos] + [frozenset(combos)]


def _score(model: OrderModel, caps: list[int], rule: Rule, before: list[frozenset[tuple[Stage, Stage]]],
           after: list[frozenset[tuple[Stage, Stage]]], bound: float,
           mine: frozenset[tuple[Stage, Stage]]) -> tuple[float, float]:
    """The score of the list schedule by ``rule`` with one rank's policy ``mine`` between the
    others' (``before`` and ``after`` it), bounded by ``bound``; (INF, INF) if none."""
    trial = list_schedule(model, caps, rule, None, bound, before + [mine] + after)
    return trial[0] if trial is not None else (INF, INF)


def search_policy(model: OrderModel, caps: list[int], rule: Rule, run: Run,
                  sweeps: int = SWEEPS) -> Optional[tuple[tuple[float, float], list[list[Op]], PairPolicy]]:
    """The shortest list schedule by ``rule`` found over per-rank policies, with its score and
    policy; None if none fits the caps. From pairing nothing, each rank in turn tries each of its
    other policies with the other ranks' fixed, each list schedule bounded by the best step so
    far, and keeps the best if it scores better; at most ``sweeps`` passes, or until one keeps
    nothing. ``run`` maps one rank's tries (as :class:`~.optimize.Workers` does, so the pipeline
    ranks can share them). A fixed number of list schedules, so it is deterministic."""
    policy: list[frozenset[tuple[Stage, Stage]]] = [frozenset()] * model.ranks
    got = list_schedule(model, caps, rule, None, INF, policy)
    best = got[0] if got is not None else (INF, INF)
    options = [policies(model, r) for r in range(model.ranks)]
    for _ in range(sweeps):
        kept = False
        for r in range(model.ranks):
            tries = [p for p in options[r] if p != policy[r]]
            scored = run(partial(_score, model, caps, rule, policy[:r], policy[r + 1:], best[0]), tries)
            i = min(range(len(tries)), key=lambda k: scored[k], default=None)
            if i is not None and scored[i] < best:
                best, policy[r], kept = scored[i], tries[i], True
        if not kept:
            break
    if best[0] == INF:
        return None
    got = list_schedule(model, caps, rule, None, INF, policy)
    assert got is not None and got[0] == best  # the list scheduler is deterministic
    return got[0], got[1], policy
