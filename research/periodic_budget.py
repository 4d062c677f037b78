"""Why an activation budget costs F&B pairs: the shortest period of a periodic DualPipeV order.

A periodic steady state repeats one micro-batch's ops every ``T`` on every rank: each op has a
start ``L`` on its micro-batch's timeline, and on a rank the phases ``L mod T`` of its ops may
not overlap, except that an F and a B at the same phase run as one F&B pair (``--fb`` long,
the backward without its weight grad; each W is its own op). An op starts after the op before
it on the micro-batch's round trip (F down and up the V, then B back) has ended; ``--c`` is
added on a hop between ranks. A rank's live activations are its two stages' lifetimes (F start
to W end) divided by ``T`` (Little's law). For a budget ``K`` the script asks CP-SAT, for each
period in turn, whether such an order exists with every rank's lifetimes <= K x T, and prints
``infeasible``, ``feasible`` (with the pairs it found) or ``unknown`` (time limit).

It is a model of the steady state only (no warm-up or cool-down), with one micro-batch per
period; it is evidence, not a bound on every order. It reproduces DeepSeek's 2P+1 live units at
the fully paired period.

Needs ``pip install ortools`` (not in requirements.txt; without it the script stops at once
saying so). Example (the F&B = 0.8 (F+B) cost set of ``research/schedule_budget.py``, in
tenths):

    python research/periodic_budget.py -P 4 -K 7 --periods 48:60
"""

from __future__ import annotations

import argparse
import sys

try:
    from ortools.sat.python import cp_model
except ImportError:  # optional: not in requirements.txt, only the CP-SAT scripts need it
    sys.exit("research/periodic_budget.py needs OR-Tools' CP-SAT: pip install ortools")


def solve(ranks: int, period: int, budget: int, costs: dict[str, int], seconds: float) -> tuple[str, int]:
    """CP-SAT on the periodic model: (status, pairs per period in the order found, or -1)."""
    model = cp_model.CpModel()
    horizon = 4 * ranks * costs["fb"] + 10 * period
    halves = ("a", "b")  # rank r holds stage r (its first half of the V) and 2P-1-r
    start, length, pair = {}, {}, {}
    for r in range(ranks):
        for f in halves:
            for b in halves:
                pair[r, f, b] = model.NewBoolVar(f"pair{r}{f}{b}")
            model.Add(sum(pair[r, f, b] for b in halves) <= 1)
        for b in halves:
            model.Add(sum(pair[r, f, b] for f in halves) <= 1)
    for r in range(ranks):
        slots = []
        phase = {}
        for x in halves:
            for op in "FBW":
                key = (op, x, r)
                start[key] = model.NewIntVar(0, horizon, "")
                phase[key] = model.NewIntVar(0, period - 1, "")
                model.AddModuloEquality(phase[key], start[key], period)
                alone = costs[op]
                if op == "W":  # never paired
                    paired, length[key] = None, alone
                else:
                    paired = model.NewBoolVar("")
                    model.Add(paired == (sum(pair[r, x, b] for b in halves) if op == "F"
                                         else sum(pair[r, f, x] for f in halves)))
                    length[key] = model.NewIntVar(min(alone, costs["fb"]), max(alone, costs["fb"]), "")
                    model.Add(length[key] == alone + (costs["fb"] - alone) * paired)
                for shift in (0, period):  # two copies cover a phase that wraps past T
                    at = model.NewIntVar(0, 2 * period, "")
                    model.Add(at == phase[key] + shift)
                    if op == "B":  # a paired B runs inside its F's slot
                        slots.append(model.NewOptionalFixedSizeIntervalVar(at, alone, paired.Not(), ""))
                    else:
                        end = model.NewIntVar(0, 3 * period, "")
                        model.Add(end == at + length[key])
                        slots.append(model.NewIntervalVar(at, length[key], end, ""))
        for f in halves:
            for b in halves:
                model.Add(phase[("F", f, r)] == phase[("B", b, r)]).OnlyEnforceIf(pair[r, f, b])
        model.AddNoOverlap(slots)
        for x in halves:
            model.Add(start[("W", x, r)] >= start[("B", x, r)] + length[("B", x, r)])
        lifetimes = sum(start[("W", x, r)] + costs["W"] - start[("F", x, r)] for x in halves)
        model.Add(lifetimes <= budget * period)

    def where(op: str, stage: int) -> tuple[str, str, int]:
        return (op, "a", stage) if stage < ranks else (op, "b", 2 * ranks - 1 - stage)

    trip = [where("F", s) for s in range(2 * ranks)] + [where("B", s) for s in range(2 * ranks - 1, -1, -1)]
    model.Add(start[trip[0]] == 0)
    for before, after in zip(trip, trip[1:]):
        hop = costs["c"] if before[2] != after[2] else 0
        model.Add(start[after] >= start[before] + length[before] + hop)
    model.Maximize(sum(pair.values()))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return "feasible", int(solver.ObjectiveValue())
    return ("infeasible" if status == cp_model.INFEASIBLE else "unknown"), -1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-P", "--ranks", type=int, required=True)
    parser.add_argument("-K", "--budget", type=int, required=True, help="live (d,s,m) units per rank")
    parser.add_argument("--periods", default="48:60", help="first:last period to try, in tenths")
    parser.add_argument("--F", type=int, default=10)
    parser.add_argument("--B", type=int, default=15, help="the backward without its weight grad")
    parser.add_argument("--W", type=int, default=5)
    parser.add_argument("--fb", type=int, default=19, help="an F&B pair, the backward without its weight grad")
    parser.add_argument("--c", type=int, default=0, help="p2p latency of a hop between ranks")
    parser.add_argument("--seconds", type=float, default=60.0, help="CP-SAT time limit per period")
    args = parser.parse_args()
    first, last = (int(x) for x in args.periods.split(":"))
    costs = {"F": args.F, "B": args.B, "W": args.W, "fb": args.fb, "c": args.c}
    for period in range(first, last + 1):
        status, pairs = solve(args.ranks, period, args.budget, costs, args.seconds)
        found = f", {pairs} F&B pairs per period" if pairs >= 0 else ""
        print(f"P={args.ranks} K={args.budget} T={period}: {status}{found}", flush=True)
        if status == "feasible":
            break


if __name__ == "__main__":
    main()
