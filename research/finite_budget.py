"""How close to DeepSeek's step can any DualPipeV order get under an activation budget K?

``research/schedule_budget.py`` compares DeepSeek's order with what the heuristic optimizer
(:func:`~dualpipe_megatron.schedules.optimize.optimize_order`) finds within K live (d,s,m) per
rank; this script asks CP-SAT about every order of the same placement, warm-up and cool-down
included, to find a shorter one or a lower bound on the makespan that the heuristic's gap can be
judged against.

The model, in integer tenths of the cost unit: each (s,m) has an F, a B (input grads only) and a
W, with a start each. An F and a B on one rank may run as one F&B pair (a bool per candidate
pair): both start together and both end ``fb - W`` later; an unpaired F lasts F, an unpaired B
``B - W``, a W lasts W. A rank runs one op at a time (NoOverlap) and holds (s,m) live from its
F's start to its W's end, at most K at once (Cumulative); the project's dependencies
(``events.KINDS``) hold, plus ``--c`` on a hop between ranks. The objective is the makespan.

Assumptions, which is what the lower bound covers:

- Split backwards only. A full backward (alone or in a pair) is never better than the split one
  followed at once by its W: same rank time, same activation lifetime, and its input grads
  leave earlier. So this loses no order's makespan.
- Micro-batches in order per stage (F(s,m) before F(s,m+1), likewise B and W), as DeepSeek's
  order keeps them (the optimizer's may swap W's of a stage: the hint sorts them, which changes
  neither validity nor live counts). It is a symmetry break, not proved
  harmless: the bound holds over orders that keep micro-batches in order per stage. With it a
  pair's B has an earlier micro-batch than its F (a later one depends on that F), so only those
  candidate pairs are made.
- ``--window N`` keeps only pairs with ``m_F - m_B <= N``: a smaller model, but then the bound
  is no longer a bound on every order (the script says so).

``--free-last X`` frees only the ops of the optimizer's order that start in its last X time units;
the rest keep their starts and pairs. CP-SAT's lower bound then holds over the orders that agree
with the optimizer's before that time: whether a better cool-down alone could reach a target.

``--sweep X`` is a large-neighbourhood search instead of one solve: CP-SAT reorders the ops that
start in a window of X time units, the earlier ones fixed and the later ones kept in their order
and pairs on each rank but free to move in time, with the makespan first and then the free ops'
starts as the objective; windows half a width apart, ``--rounds`` passes, each order that checks
out no longer (``validate``, ``simulate``, peaks <= K) the next start. It finds orders and
proves nothing. ``--start FILE`` starts from a saved order (``--save``) instead.

CP-SAT starts from the optimizer's order under K (a hint, and its makespan as the horizon, so
what is found is never worse, and INFEASIBLE means no such order is shorter). A solution is turned into op lists (pairs as
``FB(F, B(w=False))``, each rank's ops by start) and checked with the project's ``validate``,
``simulate`` (no longer than CP-SAT's makespan) and ``peak_live_activations`` (<= K).

Needs ``pip install ortools`` (not in requirements.txt; without it the script stops at once
saying so). Examples (the "uniform F1 B2 W0.5 FB2.4" set of ``research/schedule_budget.py``;
with one worker CP-SAT's default search barely moves from the start, ``interleave_search`` runs
its portfolio, LNS included, in that one thread):

    python research/finite_budget.py -P 4 -M 16 -K 7 --seconds 150 --params interleave_search=True
    python research/finite_budget.py -P 16 -M 64 -K 25 --free-last 100 --seconds 120 --params interleave_search=True
    python research/finite_budget.py -P 8 -M 32 -K 13 --sweep 40 --seconds 40 --rounds 4 --params interleave_search=True --save a.json
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dualpipe_megatron.schedules import B, F, FB, Key, Schedule, W, build_schedule, simulate, validate  # noqa: E402
from dualpipe_megatron.schedules.events import peak_live_activations  # noqa: E402
from dualpipe_megatron.schedules.ir import halves  # noqa: E402
from dualpipe_megatron.schedules.simulate import Costs, StageCosts  # noqa: E402

try:
    from ortools.sat.python import cp_model
except ImportError:  # optional: not in requirements.txt, only the CP-SAT scripts need it
    sys.exit("research/finite_budget.py needs OR-Tools' CP-SAT: pip install ortools")


def project_costs(sched: Schedule, tenths: dict[str, int]) -> StageCosts:
    """The project's cost object for the same figures (full B and full F&B, as Costs takes them)."""
    return StageCosts.uniform(sched, Costs.of(*(Fraction(tenths[k], 10) for k in ("F", "B", "W", "fb", "c"))))


def hint_from(sched: Schedule, costs: StageCosts) -> dict[tuple[str, int, int], tuple[int, object]]:
    """Starts (in tenths) of an order's ops, full backwards as split ones with their W right after:
    {(kind, s, m): (start, partner key of a pair or None)}."""
    run = simulate(sched, costs)
    got: dict = {}
    for rank, ops in enumerate(sched.ops):
        for op, at in zip(ops, run.start[rank]):
            t = at * 10
            assert t.denominator == 1, "hint times must be whole tenths"
            t = int(t)
            pair = isinstance(op, FB)
            for h in halves(op):
                k = (h.key.s, h.key.m)
                if isinstance(h, F):
                    got[("F",) + k] = (t, (op.b.key.s, op.b.key.m) if pair else None)
                elif isinstance(h, B):
                    got[("B",) + k] = (t, (op.f.key.s, op.f.key.m) if pair else None)
                    if h.w:  # the dominance: split it, its W in the op's last W of time
                        got[("W",) + k] = (t + int((costs.duration(op) - costs.stages[0, k[0]].W) * 10), None)
                else:
                    got[("W",) + k] = (t, None)
    # W times sorted per stage: the same order up to which W runs where. Still valid when F and
    # B are in micro-batch order (the k-th W is after the k-th B's end), and a rank's live count
    # at any time is the same (F starts and W ends as sets unchanged)
    for st in range(sched.stages):
        times = sorted(got[("W", st, m)][0] for m in range(sched.microbatches))
        for m, t in enumerate(times):
            got[("W", st, m)] = (t, None)
    return got


def solve(P: int, M: int, K: int, tenths: dict[str, int], seconds: float, workers: int,
          window: int | None, hint: dict | None, horizon: int, log: bool, params: str = "",
          fixed_before: int | None = None, kept_after: int | None = None):
    """CP-SAT on every order (see the module docstring): (status name, best makespan in tenths
    or None, lower bound in tenths, wall seconds, per-rank op lists or None). With
    ``fixed_before`` (tenths; needs ``hint``) the hint's ops that start earlier keep their start
    and pairing; with ``kept_after`` the ones that start at or after it keep their pairing and
    their order on each rank but may move in time. Only the ops between are free."""

    def pinned(key: tuple[str, int, int]) -> bool:  # keeps its start and pairing
        return fixed_before is not None and hint[key][0] < fixed_before

    def kept(key: tuple[str, int, int]) -> bool:  # keeps its pairing and place on its rank
        return kept_after is not None and hint[key][0] >= kept_after

    def free(key: tuple[str, int, int]) -> bool:
        return not (pinned(key) or kept(key))

    S = 2 * P
    rank_of = {s: (s if s < P else S - 1 - s) for s in range(S)}
    dF, dB, dW, dP, c = tenths["F"], tenths["B"] - tenths["W"], tenths["W"], tenths["fb"] - tenths["W"], tenths["c"]
    model = cp_model.CpModel()
    st, en = {}, {}
    paired = {}
    for s in range(S):
        for m in range(M):
            for kind in "FBW":
                st[kind, s, m] = model.NewIntVar(0, horizon, f"{kind}{s},{m}")
                en[kind, s, m] = model.NewIntVar(0, horizon, f"e{kind}{s},{m}")
            for kind in "FB":
                paired[kind, s, m] = model.NewBoolVar(f"p{kind}{s},{m}")
    # candidate pairs on each rank: F(sf,mf) with B(sb,mb), mb < mf (see the docstring)
    x = {}
    for r in range(P):
        mine = (r, S - 1 - r)
        for sf in mine:
            for sb in mine:
                for mf in range(M):
                    for mb in range(mf):
                        fixed = not (free(("F", sf, mf)) and free(("B", sb, mb)))
                        if fixed and hint["F", sf, mf][1] == (sb, mb):  # a pair of the fixed part
                            x[sf, mf, sb, mb] = model.NewBoolVar(f"x{sf},{mf},{sb},{mb}")
                            model.Add(x[sf, mf, sb, mb] == 1)
                        elif not fixed and (window is None or mf - mb <= window):
                            x[sf, mf, sb, mb] = model.NewBoolVar(f"x{sf},{mf},{sb},{mb}")
    by_f: dict = {}
    by_b: dict = {}
    for (sf, mf, sb, mb), v in x.items():
        by_f.setdefault((sf, mf), []).append(v)
        by_b.setdefault((sb, mb), []).append(v)
        model.Add(st["F", sf, mf] == st["B", sb, mb]).OnlyEnforceIf(v)
    for s in range(S):
        for m in range(M):
            model.Add(paired["F", s, m] == sum(by_f.get((s, m), [])))
            model.Add(paired["B", s, m] == sum(by_b.get((s, m), [])))
            model.Add(en["F", s, m] == st["F", s, m] + dF + (dP - dF) * paired["F", s, m])
            model.Add(en["B", s, m] == st["B", s, m] + dB + (dP - dB) * paired["B", s, m])
            model.Add(en["W", s, m] == st["W", s, m] + dW)
            for kind in "FBW":
                if pinned((kind, s, m)):
                    model.Add(st[kind, s, m] == hint[kind, s, m][0])
            # dependencies (events.KINDS), latency c on a hop between ranks
            if s > 0:
                hop = c if rank_of[s - 1] != rank_of[s] else 0
                model.Add(st["F", s, m] >= en["F", s - 1, m] + hop)
            model.Add(st["B", s, m] >= en["F", s, m])
            if s < S - 1:
                hop = c if rank_of[s + 1] != rank_of[s] else 0
                model.Add(st["B", s, m] >= en["B", s + 1, m] + hop)
            model.Add(st["W", s, m] >= en["B", s, m])
            if m > 0:  # micro-batches in order per stage
                for kind in "FBW":
                    model.Add(st[kind, s, m] >= en[kind, s, m - 1])
    if kept_after is not None:  # the kept ops run in the hint's order on each rank
        for r in range(P):
            # one entry per slot: a paired F runs in its B's slot
            tail = sorted((t, key) for key, (t, partner) in hint.items()
                          if kept(key) and rank_of[key[1]] == r and not (key[0] == "F" and partner))
            for (_, a), (_, b) in zip(tail, tail[1:]):
                model.Add(st[b] >= en[a])
    makespan = model.NewIntVar(0, horizon, "makespan")
    for r in range(P):
        slots, live = [], []
        for s in (r, S - 1 - r):
            for m in range(M):
                # an F in a pair runs inside its B's slot
                slots.append(model.NewOptionalFixedSizeIntervalVar(st["F", s, m], dF, paired["F", s, m].Not(), ""))
                b_len = model.NewIntVar(min(dB, dP), max(dB, dP), "")
                model.Add(b_len == dB + (dP - dB) * paired["B", s, m])
                slots.append(model.NewIntervalVar(st["B", s, m], b_len, en["B", s, m], ""))
                slots.append(model.NewFixedSizeIntervalVar(st["W", s, m], dW, ""))
                # the round trip from here and back, each op at its shortest (helps the energy bound)
                hops = sum(rank_of[a] != rank_of[a + 1] for a in range(s, S - 1))
                shortest = (S - s) * (min(dF, dP) + min(dB, dP)) + dW + 2 * c * hops
                life = model.NewIntVar(shortest, horizon, "")
                live.append(model.NewIntervalVar(st["F", s, m], life, en["W", s, m], ""))
                model.Add(makespan >= en["W", s, m])
                model.Add(makespan >= en["B", s, m])
        model.AddNoOverlap(slots)
        model.AddCumulative(live, [1] * len(live), K)
    weight = 1  # with kept_after: the makespan first, then the unpinned ops' starts (so a window
    # that cannot shorten the step still moves work earlier for the next window to use)
    if kept_after is None:
        model.Minimize(makespan)
    else:
        movable = [v for key, v in st.items() if not pinned(key)]
        weight = len(movable) * horizon + 1
        model.Minimize(weight * makespan + sum(movable))
    if hint:
        for key, (t, _) in hint.items():
            model.AddHint(st[key], t)
        for s in range(S):
            for m in range(M):
                for kind in "FB":
                    model.AddHint(paired[kind, s, m], hint[kind, s, m][1] is not None)
        for (sf, mf, sb, mb), v in x.items():
            model.AddHint(v, hint["F", sf, mf][1] == (sb, mb))
        model.AddHint(makespan, max(t + {"F": dF, "B": dB, "W": dW}[k[0]] for k, (t, _) in hint.items()))

    class Progress(cp_model.CpSolverSolutionCallback):
        def __init__(self) -> None:
            super().__init__()
            self.t0 = time.time()

        def on_solution_callback(self) -> None:
            print(f"  {time.time() - self.t0:7.1f}s: makespan {self.Value(makespan) / 10:.1f}, "
                  f"bound {self.BestObjectiveBound() // weight / 10:.1f}", flush=True)

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    solver.parameters.log_search_progress = log
    for item in filter(None, params.split(",")):  # "name=value,..." (SatParameters fields)
        field, value = item.split("=")
        setattr(solver.parameters, field.strip(), ast.literal_eval(value.strip()))
    fixed = "" if fixed_before is None else f", ops starting before {fixed_before / 10} fixed"
    print(f"model: {len(x)} candidate pairs, horizon {horizon / 10}{fixed}", flush=True)
    t0 = time.time()
    status = solver.Solve(model, Progress())
    wall = time.time() - t0
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, None, solver.BestObjectiveBound() // weight, wall, None
    ops: list[list[tuple[int, object]]] = [[] for _ in range(P)]
    partner = {(sf, mf): (sb, mb) for (sf, mf, sb, mb), v in x.items() if solver.Value(v)}
    taken = set(partner.values())
    for s in range(S):
        r = rank_of[s]
        for m in range(M):
            k = Key(0, s, m)
            if (s, m) in partner:
                sb, mb = partner[s, m]
                ops[r].append((solver.Value(st["F", s, m]), FB(F(k), B(Key(0, sb, mb), False))))
            else:
                ops[r].append((solver.Value(st["F", s, m]), F(k)))
            if (s, m) not in taken:
                ops[r].append((solver.Value(st["B", s, m]), B(k, False)))
            ops[r].append((solver.Value(st["W", s, m]), W(k)))
    lists = [[op for _, op in sorted(row, key=lambda p: p[0])] for row in ops]
    return name, solver.Value(makespan), solver.BestObjectiveBound() // weight, wall, lists


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-P", "--ranks", type=int, required=True)
    parser.add_argument("-M", "--microbatches", type=int, required=True)
    parser.add_argument("-K", "--budget", type=int, required=True, help="live (d,s,m) units per rank")
    parser.add_argument("--F", type=int, default=10, help="costs in tenths: forward")
    parser.add_argument("--B", type=int, default=20, help="the full backward (its W included)")
    parser.add_argument("--W", type=int, default=5)
    parser.add_argument("--fb", type=int, default=24, help="an F&B pair with the full backward")
    parser.add_argument("--c", type=int, default=0, help="p2p latency of a hop between ranks")
    parser.add_argument("--seconds", type=float, default=60.0, help="CP-SAT time limit")
    parser.add_argument("--workers", type=int, default=1, help="CP-SAT workers (threads)")
    parser.add_argument("--window", type=int, default=None,
                        help="only pairs with m_F - m_B <= this (then CP-SAT's bound is not a bound)")
    parser.add_argument("--no-hint", action="store_true", help="skip the optimizer's order as a start")
    parser.add_argument("--log", action="store_true", help="CP-SAT's search log")
    parser.add_argument("--params", default="", help="more CP-SAT parameters: 'linearization_level=2,...'")
    parser.add_argument("--save", help="write the order found (schedule JSON) here")
    parser.add_argument("--free-last", type=float, default=None,
                        help="free only the optimizer's ops that start in the last this many time units; "
                             "the rest keep their starts and pairs (then the bound holds over orders "
                             "that agree with the optimizer's before that time)")
    parser.add_argument("--start", help="start from this order (schedule JSON) instead of the optimizer's")
    parser.add_argument("--sweep", type=float, default=None,
                        help="large-neighbourhood search: free windows of this many time units in turn")
    parser.add_argument("--rounds", type=int, default=1, help="passes of --sweep over the order")
    args = parser.parse_args()
    P, M, K = args.ranks, args.microbatches, args.budget
    tenths = {"F": args.F, "B": args.B, "W": args.W, "fb": args.fb, "c": args.c}

    deepseek = build_schedule("dualpipev", P, M)
    costs = project_costs(deepseek, tenths)
    base = simulate(deepseek, costs)
    print(f"P={P} M={M} K={K}, costs {tenths} (tenths)")
    print(f"DeepSeek's order: makespan {float(base.makespan)}, peak "
          f"{max(peak_live_activations(o) for o in deepseek.ops)}", flush=True)
    hint, horizon = None, 4 * M * (tenths["F"] + tenths["B"] + tenths["c"]) * 2
    if not args.no_hint and not args.start:
        from dualpipe_megatron.schedules.optimize import optimize_order

        t0 = time.time()
        ours = optimize_order(deepseek, costs, max_activations=K)
        run = simulate(ours, costs)
        print(f"optimizer's order: makespan {float(run.makespan)}, peak "
              f"{max(peak_live_activations(o) for o in ours.ops)} ({time.time() - t0:.1f}s)", flush=True)
        hint = hint_from(ours, costs)
        in_order = all(hint[k, s, m][0] < hint[k, s, m + 1][0]
                       for k in "FBW" for s in range(2 * P) for m in range(M - 1))
        horizon = int(run.makespan * 10)  # what CP-SAT finds is never longer
        if not in_order:
            print("  (its micro-batches are not in order per stage: no hint)")
            hint = None
    if args.start:
        with open(args.start) as f:
            ours = Schedule.from_json_obj(json.load(f))
        hint, horizon = hint_from(ours, costs), int(simulate(ours, costs).makespan * 10)
        print(f"start: {args.start}, makespan {horizon / 10}")
    if args.sweep is not None:
        if args.free_last is not None:
            parser.error("--sweep and --free-last are two different searches: give one")
        if hint is None:
            parser.error("--sweep needs a start in micro-batch order per stage")
        sweep(args, deepseek, costs, float(base.makespan), ours, tenths)
        return
    fixed_before = None
    if args.free_last is not None:
        if hint is None:
            parser.error("--free-last needs the optimizer's order as a hint, in micro-batch order per stage")
        fixed_before = horizon - int(args.free_last * 10)
    window = "" if args.window is None else f", pairs within {args.window} micro-batches (NOT a bound on all orders)"
    print(f"CP-SAT: {args.seconds:g}s, {args.workers} worker(s){window}", flush=True)
    status, best, bound, wall, lists = solve(P, M, K, tenths, args.seconds, args.workers, args.window,
                                             hint, horizon, args.log, args.params, fixed_before)
    found = "none" if best is None else f"{best / 10:.1f}"
    print(f"CP-SAT: status {status}, best makespan {found}, lower bound {bound / 10:.1f} "
          f"({bound / float(base.makespan) / 10 - 1:+.1%} over DeepSeek), {wall:.1f}s")
    if lists is None:
        return
    sched = as_schedule(deepseek, lists)
    valid, span, peaks = check(sched, costs)
    print(f"check: validate {valid}")
    if args.save:
        with open(args.save, "w") as f:
            f.write(sched.to_json())
    if valid == "ok":
        print(f"check: simulate makespan {float(span)} ({'ok' if span * 10 <= best else 'LONGER than CP-SAT'}; "
              f"{float(span / base.makespan) - 1:+.1%} over DeepSeek), peaks {peaks} "
              f"({'ok' if max(peaks) <= K else 'OVER K'})")


def as_schedule(like: Schedule, lists: list) -> Schedule:
    """CP-SAT's op lists as a schedule of ``like``'s shape."""
    return Schedule(f"{like.name}-cpsat", like.ranks, like.stages, like.microbatches,
                    like.directions, lists, dict(like.placement))


def check(sched: Schedule, costs: StageCosts) -> tuple[str, Fraction | None, list[int]]:
    """The project's own verdict on an order CP-SAT found: (validate's, makespan, per-rank peaks)."""
    try:
        validate(sched)
    except Exception as exc:  # report, do not hide: the check is the point
        return f"FAILED: {exc}", None, []
    return "ok", simulate(sched, costs).makespan, [peak_live_activations(o) for o in sched.ops]


def sweep(args: argparse.Namespace, like: Schedule, costs: StageCosts, deepseek: float,
          current: Schedule, tenths: dict[str, int]) -> None:
    """Large-neighbourhood search: CP-SAT reorders the ops that start in one window of time, the
    earlier ones fixed and the later ones kept in order on each rank (free to move in time),
    window after window (half a width apart) for ``--rounds`` passes; an order that checks out no
    longer becomes the next start. Finds orders, proves nothing (each bound is the window's)."""
    width = int(args.sweep * 10)
    span = simulate(current, costs).makespan
    for rnd in range(args.rounds):
        at = 0
        while at < span * 10:
            hint, horizon = hint_from(current, costs), int(span * 10)
            status, best, _, wall, lists = solve(args.ranks, args.microbatches, args.budget, tenths,
                                                 args.seconds, args.workers, args.window, hint, horizon,
                                                 False, args.params, at, at + width)
            got = "none" if best is None else f"{best / 10:.1f}"
            if lists is not None:
                sched = as_schedule(like, lists)
                valid, new, peaks = check(sched, costs)
                if valid != "ok" or max(peaks) > args.budget:
                    raise SystemExit(f"window {at / 10}: CP-SAT's order fails the project's checks: {valid} {peaks}")
                if new <= span:  # the same step with work moved earlier is kept too
                    current, span = sched, new
                    if args.save:
                        with open(args.save, "w") as f:
                            f.write(current.to_json())
            print(f"round {rnd} window [{at / 10:g}, {(at + width) / 10:g}): {status} {got} in {wall:.0f}s; "
                  f"now {float(span)} ({float(span) / deepseek - 1:+.1%} over DeepSeek)", flush=True)
            at += width // 2


if __name__ == "__main__":
    main()
