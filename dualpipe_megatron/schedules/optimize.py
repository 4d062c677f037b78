"""Op-order optimizer: a schedule no slower and no hungrier than its input, usually faster.

DeepSeek's DualPipe/DualPipeV order is fixed by hand for one cost shape. Given the real
per-stage costs, :func:`optimize_order` searches for a better order within the same
placement and micro-batches. It builds candidates with a memory-capped list scheduler
(several priority rules), then improves the input and the best candidates by an iterated
local search on the critical path (swap, split or pair F&B, defer or move weight grads; when
it stalls, a few seeded random moves and again), spending its work by successive halving over
those starts (the input, and the input with its full backwards split into B(w=false) and W,
among them). It returns the best order that the exact :func:`~.simulate.simulate` confirms to
be no longer than the input, with no rank's peak live activations above that rank's peak in
the input. With an activation budget K (``max_activations``) every rank's cap is K instead,
and the result is the fastest order found within it, slower than the input if the input does
not fit; the list scheduler then also tries admission rules that cannot stall for memory (a
micro-batch enters a rank only with room for all its stages there; or one enters only while
few enough of its direction are in flight, with a banker's margin for the oldest micro-batch),
orders that follow the input's op ranks and pairs under the cap, and, where F&B pairs save
time, the best unpaired rule's list schedule with per-rank pairing policies
(:mod:`.pair_policy`). The one-micro-batch-at-a-time order, which meets the minimum
(:func:`min_activations`), is the fallback start. The search is bounded by work, not time, and
deterministic; it times schedules with floats, re-timing only what follows a move
(:func:`~.events.timing`'s ``since``), and only the final check is exact. Its pieces (each list schedule, each search,
each exact check) are independent, so :class:`Workers` may run them apart (the pipeline ranks
of a training job do) and the order is the same.

The pieces live beside it: the model of one schedule the search works on
(:mod:`.order_model`), the list scheduler (:mod:`.list_scheduler`), its pairing policies
(:mod:`.pair_policy`) and the local search (:mod:`.local_search`); this module composes them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

from .events import peak_live_activations
from .ir import B, F, FB, Key, Op, Schedule, ScheduleError, W
from .list_scheduler import BUDGET_RULES, RULES, Admission, Reference, Rule, list_schedule
from .local_search import local_search
from .order_model import INF, OrderModel, Packed, order_score
from .pair_policy import search_policy
from .simulate import AnyCosts, simulate

# The default work bound: local-search evaluations per start scale as this many op-simulations
# (bounded below, and above by _MAX_EVALS per SEARCH_WORK of work).
SEARCH_WORK = 400_000
_MIN_EVALS, _MAX_EVALS = 60, 2000
_BUILT_SEEDS = 6  # list-scheduled orders the local search starts from


def min_activations(sched: Schedule) -> int:
    """The smallest per-rank budget any valid order of ``sched``'s placement can meet.

    A rank holding k stages of one direction has all k of one micro-batch live when the
    deepest of them starts its F (the shallower ones' weight grads wait for its B), so no
    order goes below the largest such k; the one-micro-batch-at-a-time order
    (:func:`_sequential`) reaches it. DualPipeV's V gives 2, DualPipe and 1F1B 1.
    """
    per_rank: dict[tuple[int, int], int] = {}
    for d, s in sched.placement:
        at = (sched.placement[(d, s)], d)
        per_rank[at] = per_rank.get(at, 0) + 1
    return max(per_rank.values(), default=1)


def _sequential(model: OrderModel) -> list[list[Op]]:
    """One micro-batch through every stage and back before the next starts: the slowest
    order, and the one that meets :func:`min_activations`."""
    out: list[list[Op]] = [[] for _ in range(model.ranks)]
    for m in range(model.per):
        for d in range(model.directions):
            for s in range(model.stages):
                out[model.rank[(d, s)]].append(F(Key(d, s, m)))
            for s in range(model.stages - 1, -1, -1):
                out[model.rank[(d, s)]].append(B(Key(d, s, m)))
    return out


def _split_weight_grads(ops: list[list[Op]]) -> list[list[Op]]:
    """``ops`` with every full backward (alone or in an F&B pair) split into its input-grad
    part and the weight grad right after it: the same peak, and the B's output leaves a W
    earlier; DeepSeek's steady pairs run full backwards, so this is often faster outright."""
    out: list[list[Op]] = []
    for rank_ops in ops:
        split: list[Op] = []
        for op in rank_ops:
            back = op.b if isinstance(op, FB) else op
            if isinstance(back, B) and back.w:
                short = B(back.key, False)
                split += [FB(op.f, short) if isinstance(op, FB) else short, W(back.key)]
            else:
                split.append(op)
        out.append(split)
    return out


class Workers(Protocol):
    """Where the search's independent pieces run: ``map`` runs ``fn`` on every task (task i on
    worker i % ``count``) and returns every result, in task order, to every caller. A piece's
    result depends only on its task and is plain data (ops, scores), so the order found is the
    same for any count: the pipeline ranks of a training job share the search this way
    (:class:`~dualpipe_megatron.runtime.shared_search.RankWorkers`)."""

    count: int

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]: ...


class SerialWorkers:
    """Every piece here, in task order."""

    count = 1

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]:
        return [fn(task) for task in tasks]


_Built = tuple[tuple[float, float], int, Packed]  # a list schedule: score, candidate index, order


def _keep(best: list[_Built], entry: _Built) -> list[_Built]:
    """``best`` (at most _BUILT_SEEDS distinct orders, by score, then candidate index) offered
    ``entry``: rules often build the same order, and a second search from it would only repeat
    the first."""
    if len(best) == _BUILT_SEEDS and entry[:2] > best[-1][:2]:
        return best
    if any(entry[2] == kept[2] for kept in best):
        return best
    return sorted(best + [entry], key=lambda x: x[:2])[:_BUILT_SEEDS]


def _build(model: OrderModel, caps: list[int], candidates: list, given: list[list[list[Op]]],
           follow: Sequence[list[list[Op]]], part: list[int], bound: float = INF) -> list[_Built]:
    """The list schedules of ``candidates[i]`` (a rule, and the index of the order in ``follow``
    it follows, or None) for i in ``part``, last first, that complete within the caps and differ
    from the seeds (``given``). Each stops once its makespan is sure to exceed ``bound`` or the
    sixth best of this part's so far; it returns those no longer than the part's sixth best. A
    bound no shorter than the sixth best of all candidates loses none of the best of all, and an
    order longer than six others of its part is not among them, however the candidates are parted."""
    best: list[_Built] = []
    out: list[_Built] = []
    refs: dict[int, Reference] = {}  # built here, by the worker that follows it
    for i in sorted(part, reverse=True):
        rule, j = candidates[i]
        if j is not None and j not in refs:
            refs[j] = Reference(follow[j])
        got = list_schedule(model, caps, rule, None if j is None else refs[j],
                             min(bound, best[-1][0][0] if len(best) == _BUILT_SEEDS else INF))
        if got is None or any(got[1] == order for order in given):
            continue
        out.append((got[0], i, model.pack(got[1])))
        best = _keep(best, out[-1])
    return [entry for entry in out if len(best) < _BUILT_SEEDS or entry[0] <= best[-1][0]]


def _searched(model: OrderModel, start: Packed, caps: list[int], work: int) -> tuple[tuple[float, float], Packed]:
    """:func:`local_search` from ``start``, as plain data (its score and order); the start is
    decoded here, by the worker that searches it."""
    lists, t = local_search(model, [[model.enc(op) for op in ops] for ops in model.unpack(start)], caps, work)
    return order_score(t), model.pack([[o.op for o in ops] for ops in lists])


def _best_built(built: list[_Built]) -> list[_Built]:
    """The best distinct list schedules, offered as one part building them all would (last first)."""
    best: list[_Built] = []
    for entry in sorted(built, key=lambda x: -x[1]):
        best = _keep(best, entry)
    return best


def _search(model: OrderModel, caps: list[int], seeds: list[list[list[Op]]], budget: int, workers: Workers,
            rules: tuple[Rule, ...] = RULES, follow: tuple[list[list[Op]], ...] = (),
            policy: bool = False) -> list[tuple[tuple[float, float], Packed]]:
    """Local search from each seed and from the best distinct orders (none equal to a seed) the
    list scheduler builds under ``caps`` by any of ``rules`` (and following each order in
    ``follow``), by successive halving within :func:`_halving_work`: every start gets a short
    search (``budget // 8`` op-simulations), the best half of them twice as long, and so on
    until one is left, which gets the rest: no start is judged by its list-scheduled length
    alone, and the best goes deepest (a descent there is what the work cuts short). Every list
    schedule and every search is one piece for ``workers``; with more than one worker, each
    first builds one list schedule unbounded, and the sixth best of those bounds the rest. With
    ``policy``, the best list schedule of an unpaired rule also gets per-rank pairing policies
    (:func:`~.pair_policy.search_policy`), and what that finds is one more list schedule."""
    admits: dict[Admission, Rule] = {}  # following an order uses a rule's admission only: one rule per admission
    for rule in rules:
        admits.setdefault(rule.admission, rule)
    candidates = [(rule, None) for rule in rules] + [(rule, j) for j in range(len(follow)) for rule in admits.values()]
    # the last candidates (following an order, windowed entry) are most often the shortest: tried
    # first, they set the bound early
    order = list(range(len(candidates) - 1, -1, -1))
    first = order[:workers.count] if workers.count > 1 else []
    rest = order[len(first):]

    def build(parts: list[list[int]], bound: float) -> list[_Built]:
        return [entry for got in workers.map(lambda part: _build(model, caps, candidates, seeds, follow, part, bound),
                                             parts) for entry in got]

    built = build([[i] for i in first], INF) if first else []
    best = _best_built(built)
    bound = best[-1][0][0] if len(best) == _BUILT_SEEDS else INF
    if rest:
        built += build([rest[w::workers.count] for w in range(workers.count)], bound)
    unpaired = [entry for entry in built if entry[1] < len(rules) and not rules[entry[1]].priority.pair]
    if policy and unpaired:
        got = search_policy(model, caps, rules[min(unpaired, key=lambda x: x[:2])[1]], workers.map)
        if got is not None and not any(got[1] == order for order in seeds):
            built.append((got[0], len(candidates), model.pack(got[1])))
    starts = [model.pack(ops) for ops in seeds] + [kept[2] for kept in _best_built(built)]
    found: list[tuple[tuple[float, float], Packed]] = []
    left, share = _halving_work(len(starts), budget), max(1, budget // 8)
    while starts:
        if len(starts) == 1:
            share = left
        ranked = sorted((score, k, ops) for k, (score, ops) in
                        enumerate(workers.map(lambda start: _searched(model, start, caps, share), starts)))
        left -= share * len(starts)
        found += [(score, ops) for score, _, ops in ranked]
        starts = [ops for _, _, ops in ranked[:len(ranked) // 2]]
        share *= 2
    return found


def _halving_work(starts: int, budget: int) -> int:
    """The whole work of :func:`_search`'s successive halving over ``starts`` starts: what rounds
    of ``budget // 4``, ``budget // 2``, then ``budget`` op-simulations per start would take,
    the better half going on each time. :func:`_search` gives each round's starts half those
    shares and the last start what is left: from six list schedules, 4 x ``budget`` in all,
    of which 2.5 x on the best (with the shares above it would get 1 x)."""
    total, share = 0, max(1, budget // 4)
    while starts:
        total += starts * share
        starts //= 2
        share = min(budget, 2 * share)
    return total


def optimize_order(sched: Schedule, costs: AnyCosts, max_activations: Optional[int] = None,
                   work: int = SEARCH_WORK, workers: Optional[Workers] = None) -> Schedule:
    """A reordering of ``sched`` (same placement and micro-batches); deterministic.

    Without ``max_activations`` it is never slower under ``costs`` and never raises any rank's
    peak live activations. With it, every rank's peak is at most ``max_activations`` (in
    (d,s,m) units, :func:`~.events.peak_live_activations`), and the order is the fastest found
    under that budget: never slower than the input (nor than no budget) when the input fits,
    possibly slower when it does not. A budget below :func:`min_activations` raises.

    ``work`` bounds the search in op-simulations (not seconds, so every rank finds the same
    order); more work finds better orders, slower: ten times the default takes about ten
    times as long. ``workers`` (default: all here) share its independent pieces (list schedules,
    searches, exact checks); the order is the same for any workers.
    """
    if max_activations is not None and max_activations < min_activations(sched):
        raise ScheduleError(
            f"max activations {max_activations} is below the minimum {min_activations(sched)} that any "
            f"order of {sched.name} at P={sched.ranks} needs (live (d,s,m) per rank)")
    workers = SerialWorkers() if workers is None else workers
    model = OrderModel(sched, costs)
    split_ops = _split_weight_grads(sched.ops)
    n_ops = sum(map(len, sched.ops))
    if work < 1:
        raise ScheduleError(f"search work must be positive, got {work}")
    # op-simulations per start: the work, but at least _MIN_EVALS and at most _MAX_EVALS full
    # timings' worth per SEARCH_WORK of work
    budget = n_ops * max(_MIN_EVALS, min(_MAX_EVALS * work // SEARCH_WORK, work // max(1, n_ops)))
    own = [peak_live_activations(ops) for ops in sched.ops]
    fits = max_activations is None or max(own, default=0) <= max_activations
    # the input's exact step (which validates it): one worker times it, every caller learns it
    step = workers.map(lambda given: simulate(given, costs).makespan, [sched])[0]
    base = step if fits else None  # the bar to beat
    found = _search(model, own, [sched.ops, split_ops], budget, workers) if fits else []
    caps = own if max_activations is None else [max_activations] * sched.ranks
    if caps != own:  # the budget's own search, from the input if it fits, else from the leanest order
        follow = (sched.ops, split_ops)
        # an input above the budget skips the search under its own peaks: this one gets its work too
        found += _search(model, caps, [sched.ops, split_ops] if fits else [], budget if fits else 2 * budget,
                         workers, RULES + BUDGET_RULES, follow, policy=any(model.saving_pairs))
        if not found:
            found = _search(model, caps, [_sequential(model)], budget, workers)
    # the exact check, shortest first, of those shorter than the input when it fits (the first
    # usually fits): one worker each, and every caller learns the answer
    ranked = sorted(((score, i, ops) for i, (score, ops) in enumerate(found)
                     if base is None or score[0] < float(base)), key=lambda x: x[:2])
    for _, _, ops in ranked:
        out = _named(sched, model.unpack(ops))
        if workers.map(lambda new: _fits(new, costs, caps, base), [out])[0]:
            return out
    if not fits:
        raise ScheduleError(f"no order of {sched.name} at P={sched.ranks} found within "
                            f"{max_activations} live activations per rank")
    return _named(sched, [list(ops) for ops in sched.ops])


def _named(sched: Schedule, ops: list[list[Op]]) -> Schedule:
    return Schedule(f"{sched.name}-optimized", sched.ranks, sched.stages, sched.microbatches,
                    sched.directions, ops, dict(sched.placement))


def _fits(new: Schedule, costs: AnyCosts, caps: list[int], makespan) -> bool:
    """The exact check: valid, no rank above its cap, and no longer than ``makespan`` (if given)."""
    result = simulate(new, costs)  # validates
    return (makespan is None or result.makespan <= makespan) and all(
        peak_live_activations(ops) <= cap for ops, cap in zip(new.ops, caps))


__all__ = ["SerialWorkers", "Workers", "min_activations", "optimize_order"]
