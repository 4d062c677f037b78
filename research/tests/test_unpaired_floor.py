"""research/unpaired_floor.py: the floor under DualPipeV orders with no F&B pair on the V's tip.

The figures are the hand-derived ones of research/README.md, and the floor (less what the
order's pairs on the tip save) holds for every order tried: DeepSeek's, one micro-batch at a
time, and every list schedule the optimizer builds under the budget."""

from __future__ import annotations

from fractions import Fraction

import pytest
from schedule_budget import COST_SETS, costs_for  # research/: conftest.py
from unpaired_floor import tip_floor

from dualpipe_megatron.schedules import FB, Costs, ScheduleError, build_schedule, simulate
from dualpipe_megatron.schedules.events import peak_live_activations
from dualpipe_megatron.schedules.list_scheduler import BUDGET_RULES, RULES, list_schedule
from dualpipe_megatron.schedules.optimize import _named, _sequential
from dualpipe_megatron.schedules.order_model import OrderModel

pytestmark = pytest.mark.unit


def test_the_hand_derived_floors() -> None:
    """F 1, B(w=false) 1.5, W 0.5, a pair 0.6 shorter than its F and B: at P = 4, M = 16, K = 7
    the tip idles >= 5.5 in the warm-up and >= 1.5 in the cool-down (96 + 7); at P = 16,
    M = 64, K = 25, >= 29.5 and >= 13.5 (384 + 43), above +12% of DeepSeek's 369.5."""
    costs = Costs.of(1, 2, "0.5", "2.4")
    assert tip_floor(build_schedule("dualpipev", 4, 16), costs, 7) == (103, Fraction(3, 5))
    assert tip_floor(build_schedule("dualpipev", 16, 64), costs, 25) == (427, Fraction(3, 5))
    assert tip_floor(build_schedule("dualpipev", 16, 64), costs, 33)[0] == 384 + Fraction(43, 2)


@pytest.mark.parametrize("which", COST_SETS[1:3])
@pytest.mark.parametrize("microbatches", [8, 16])
def test_no_order_beats_the_floor(which: str, microbatches: int) -> None:
    sched = build_schedule("dualpipev", 4, microbatches)
    costs = costs_for(sched, which)
    model = OrderModel(sched, costs)
    orders = [sched.ops, _sequential(model)]
    for cap in (5, 7, 9):
        orders += [got[1] for rule in RULES + BUDGET_RULES
                   if (got := list_schedule(model, [cap] * sched.ranks, rule)) is not None]
    assert len(orders) > 20
    closest = None
    for ops in orders:
        tip = ops[sched.ranks - 1]
        floor, saves = tip_floor(sched, costs, peak_live_activations(tip))
        step = simulate(_named(sched, ops), costs).makespan
        allowed = floor - saves * sum(isinstance(op, FB) for op in tip)
        assert step >= allowed
        closest = min(closest or step - allowed, step - allowed)
    if which == COST_SETS[1]:  # not a vacuous floor: some order comes within two time units of it
        assert closest < 2


def test_other_schedules_and_small_runs_are_refused() -> None:
    costs = Costs.of(1, 2, "0.5", "2.4")
    with pytest.raises(ScheduleError, match="V placement"):
        tip_floor(build_schedule("dualpipe", 4, 8), costs, 4)
    with pytest.raises(ScheduleError, match="not more than the cap"):
        tip_floor(build_schedule("dualpipev", 4, 8), costs, 16)
