"""A floor under every DualPipeV order within an activation budget (issue 26): how short an
order can be that runs no F&B pair on the V's tip, and so how many pairs there an order needs
to reach a given step.

Run ``.venv/bin/python research/unpaired_floor.py [--ranks 4,8,16]``; not part of ``make test``.

The tip is rank P - 1: it holds stages P - 1 and P. Under a cap K on its live activations:

- *Warm-up.* Its first F (a stage P - 1 F) starts no earlier than the F's of stages 0..P - 2
  take (t0). Its first B waits for a whole round trip beyond it: its two F's, the F's and
  B(w=false)'s of stages P + 1..2P - 1, and 2P - 2 hops between ranks (the window). Until then
  it can only run F's, each of which stays live past the window (its weight grad follows its
  B), so at most K of them: it idles at least t0 + window - K x (its longest F).
- *Cool-down.* Its last F is a stage P F (a stage P - 1 F is followed by its micro-batch's
  stage P F). After it that micro-batch's F's beyond the tip, its input grads all the way back
  to stage 0 (every stage's B(w=false)), stage 0's weight grad and 3P - 3 hops must still run
  (the tail). The rank then has at most K live units, each with at most a full backward left:
  it idles at least tail - K x (its longest full B).
- No F&B pair fits in either window (no B exists in the first, no F in the second), and the
  two do not overlap once the rank runs more than K forwards. So any order's step is at least
  the tip's unpaired work plus both idle times, less what its pairs on the tip save; with no
  pair there, that is the floor.

Where the floor is above a target step, an order needs at least (floor - target) / (the most
one pair saves) pairs on the tip to reach it. Per case it prints DeepSeek's step, the issue's
+12% at K = ceil(3/4 x DeepSeek's peak), the floor at K, and those pairs.
"""

from __future__ import annotations

import argparse
import math
from fractions import Fraction
from typing import Union

from dualpipe_megatron.schedules import B, F, FB, Costs, Key, Schedule, ScheduleError, build_schedule, simulate
from dualpipe_megatron.schedules.cli import markdown_table, positive_ints
from dualpipe_megatron.schedules.events import peak_live_activations
from dualpipe_megatron.schedules.simulate import StageCosts

from schedule_budget import COST_SETS, costs_for, top  # research/ modules: this script's directory is on sys.path


def tip_floor(sched: Schedule, costs: Union[Costs, StageCosts], cap: int) -> tuple[Fraction, Fraction]:
    """(the least step of any order of ``sched`` whose rank P - 1 holds at most ``cap`` live
    activations and runs no F&B pair, the most one pair on that rank saves); DualPipeV only."""
    P, M = sched.ranks, sched.microbatches_per_direction
    if sched.directions != 1 or sched.stages != 2 * P or any(
            sched.placement[(0, s)] != min(s, 2 * P - 1 - s) for s in range(2 * P)):
        raise ScheduleError(f"tip_floor: needs DualPipeV's V placement, got {sched.name}")
    if 2 * M <= cap:
        raise ScheduleError(f"tip_floor: the tip runs {2 * M} forwards, not more than the cap {cap}")
    table = StageCosts.uniform(sched, costs) if isinstance(costs, Costs) else costs
    cost = {s: table.stages[(0, s)] for s in range(2 * P)}
    c = table.c
    tip = (P - 1, P)
    bi = {s: cost[s].B - cost[s].W for s in cost}  # B(w=false)
    beyond = range(P + 1, 2 * P)
    t0 = sum(cost[s].F for s in range(P - 1)) + (P - 1) * c
    window = sum(cost[s].F for s in tip) + sum(cost[s].F + bi[s] for s in beyond) + (2 * P - 2) * c
    warm = t0 + window - cap * max(cost[s].F for s in tip)
    tail = sum(cost[s].F for s in beyond) + sum(bi.values()) + cost[0].W + (3 * P - 3) * c
    cool = tail - cap * max(cost[s].B for s in tip)
    work = M * sum(cost[s].F + cost[s].B for s in tip)
    key = {s: Key(0, s, 0) for s in tip}
    saves = max(table.duration(F(key[f])) + table.duration(B(key[b])) - table.duration(FB(F(key[f]), B(key[b])))
                for f in tip for b in tip)
    return work + max(warm, Fraction(0)) + max(cool, Fraction(0)), saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=positive_ints, default=(4, 8, 16))
    args = parser.parse_args()
    rows = []
    for p in args.ranks:
        for m in (2 * p, 4 * p):
            sched = build_schedule("dualpipev", p, m)
            for which in COST_SETS:
                costs = costs_for(sched, which)
                step = simulate(sched, costs).makespan
                cap = math.ceil(3 * top(sched) / 4)
                target = Fraction(112, 100) * step
                floor, saves = tip_floor(sched, costs, cap)
                needed = max(0, math.ceil((floor - target) / saves)) if saves > 0 else None
                pairs = sum(isinstance(op, FB) for op in sched.ops[p - 1])
                rows.append([str(p), str(m), which, f"{float(step):.2f}", str(peak_live_activations(sched.ops[p - 1])),
                             str(pairs), str(cap), f"{float(target):.2f}", f"{float(floor):.2f}",
                             f"{float(saves):.2f}", "-" if needed is None else str(needed)])
    print(markdown_table(["P", "M", "costs", "DeepSeek step", "DeepSeek tip peak", "DeepSeek tip pairs", "K",
                          "+12% of DeepSeek", "floor at K, no pair on the tip", "a pair saves",
                          "tip pairs needed for +12%"], rows))


if __name__ == "__main__":
    main()
