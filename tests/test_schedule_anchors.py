"""ZB-V and Chimera, the extra anchors of the schedule comparison: shape, counts and the papers' claims."""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest

from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.ir import FB, B, F, Key, Schedule, ScheduleError, W
from dualpipe_megatron.schedules.simulate import Costs, simulate
from dualpipe_megatron.schedules.validate import validate
from dualpipe_megatron.schedules.zbv import list_order

pytestmark = pytest.mark.unit

ZBV_SHAPES = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p)]
CHIMERA_SHAPES = [(p, m) for p in (2, 4, 6, 8) for m in (p, 2 * p, 3 * p)]


def counts(sched: Schedule) -> Counter:
    return Counter((type(op).__name__, op.key) for _, _, op in sched.iter_ops())


def every_key(sched: Schedule) -> set[Key]:
    return {Key(d, s, m) for d in range(sched.directions) for s in range(sched.stages)
            for m in range(sched.microbatches_per_direction)}


@pytest.mark.parametrize("ranks,microbatches", ZBV_SHAPES)
def test_zbv_shape_counts_and_zero_bubble(ranks: int, microbatches: int) -> None:
    sched = build_schedule("zbv", ranks, microbatches)
    validate(sched)
    assert (sched.stages, sched.directions) == (2 * ranks, 1)
    assert sched.placement == {(0, s): min(s, 2 * ranks - 1 - s) for s in range(2 * ranks)}
    ops = [op for _, _, op in sched.iter_ops()]
    assert not any(isinstance(op, FB) or (isinstance(op, B) and op.w) for op in ops)
    keys = every_key(sched)
    assert counts(sched) == Counter({(kind, k): 1 for k in keys for kind in ("F", "B", "W")})
    # F = B/2 = W (the paper's T_F = T_B = T_W), stage costs halved for half-size stages:
    # every rank idles only the start-up staircase of P-1 stage forwards, and holds at most
    # 2P half-size stage activations, 1F1B's P full-size ones.
    res = simulate(sched, Costs.of().scaled(Fraction(1, 2)))
    assert res.makespan == Fraction(6 * microbatches + ranks - 1, 2)
    assert [r.bubble for r in res.per_rank] == [Fraction(ranks - 1, 2)] * ranks
    assert res.peak_activations == 2 * ranks
    assert (res.model_copies, res.params_per_rank) == (1, Fraction(1, ranks))


def test_zbv_warms_up_in_a_v() -> None:
    """Rank r runs 2(P-r)-1 forwards of its first stage before its second stage's first."""
    ranks = 6
    sched = build_schedule("zbv", ranks, 4 * ranks)
    for rank, ops in enumerate(sched.ops):
        lead = next(i for i, op in enumerate(ops) if op.key.s != rank)
        assert lead == 2 * (ranks - rank) - 1
        assert all(isinstance(op, F) for op in ops[:lead + 1])


def test_zbv_beats_1f1b_at_its_memory() -> None:
    ranks, microbatches = 4, 16
    one = simulate(build_schedule("1f1b", ranks, microbatches), Costs.of())
    zbv = simulate(build_schedule("zbv", ranks, microbatches), Costs.of().scaled(Fraction(1, 2)))
    assert zbv.peak_activations * Fraction(1, 2) == one.peak_activations
    assert zbv.max_bubble * 6 == one.max_bubble == 3 * (ranks - 1)  # (P-1)F/2 against (P-1)(F+B)
    assert zbv.makespan < one.makespan


@pytest.mark.parametrize("ranks,microbatches", CHIMERA_SHAPES)
def test_chimera_shape_counts_and_bubbles(ranks: int, microbatches: int) -> None:
    sched = build_schedule("chimera", ranks, microbatches)
    validate(sched)
    assert (sched.stages, sched.directions) == (ranks, 2)
    expected = {(0, s): s for s in range(ranks)} | {(1, s): ranks - 1 - s for s in range(ranks)}
    assert sched.placement == expected
    ops = [op for _, _, op in sched.iter_ops()]
    assert all(isinstance(op, F) or (isinstance(op, B) and op.w) for op in ops)
    keys = every_key(sched)
    assert counts(sched) == Counter({(kind, k): 1 for k in keys for kind in ("F", "B")})
    assert len({k for k in keys if k.d == 0}) == ranks * microbatches // 2
    # The paper's count under F = B: D-2 idle slots per worker (1F1B has 2(D-1)), and
    # between D/2+1 (end ranks) and D (middle ranks) micro-batches of activations.
    res = simulate(sched, Costs.of(F=1, B=1, W=Fraction(1, 2)))
    assert [r.bubble for r in res.per_rank] == [ranks - 2] * ranks
    assert [r.peak_activations for r in res.per_rank] == [
        ranks // 2 + 1 + min(r, ranks - 1 - r) for r in range(ranks)]
    assert (res.model_copies, res.params_per_rank) == (2, Fraction(2, ranks))


def test_chimera_halves_1f1b_bubbles_on_one_unit() -> None:
    ranks = 8
    costs = Costs.of(F=1, B=1, W=Fraction(1, 2))
    one = simulate(build_schedule("1f1b", ranks, ranks), costs)
    chim = simulate(build_schedule("chimera", ranks, ranks), costs)
    assert one.max_bubble == 2 * (ranks - 1) and chim.max_bubble == ranks - 2


@pytest.mark.parametrize("name,ranks,microbatches,needs", [
    ("zbv", 0, 4, "at least 1 rank"),
    ("zbv", 4, 7, "microbatches >= 2\\*ranks \\(8\\)"),
    ("chimera", 3, 6, "even number of ranks"),
    ("chimera", 1, 2, "even number of ranks"),
    ("chimera", 4, 6, "positive multiple of ranks \\(4\\)"),
    ("chimera", 4, 2, "positive multiple of ranks \\(4\\)"),
])
def test_bad_shapes_raise(name: str, ranks: int, microbatches: int, needs: str) -> None:
    with pytest.raises(ScheduleError, match=needs):
        build_schedule(name, ranks, microbatches)


def test_list_order_reports_a_stall() -> None:
    shape = Schedule("stuck", 1, 1, 1, 1, [[]], {(0, 0): 0})
    with pytest.raises(ScheduleError, match="stalled at tick 0"):
        list_order(shape, {F: 1, B: 1, W: 1}, False, lambda rank, candidates, live: None)
