"""The V-Half-like order: valid across P and M, within V-Half's cap, and about half ZB-V's memory."""

from __future__ import annotations

import pytest

from dualpipe_megatron.schedules import Costs, ScheduleError, build_schedule, simulate
from dualpipe_megatron.schedules.events import peak_live_activations
from dualpipe_megatron.schedules.vhalf import vhalf_cap

pytestmark = pytest.mark.unit

BALANCED = Costs.of(1, 2, 1, 3)  # F = B(input) = W = 1: the paper's case


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5, 8, 16])
def test_valid_and_within_the_cap(ranks: int) -> None:
    grid = {1, ranks, 2 * ranks} | ({3 * ranks + 1, 4 * ranks} if ranks < 16 else set())
    for m in sorted(grid):
        sched = build_schedule("vhalf", ranks, m)
        result = simulate(sched, BALANCED)  # validates
        peaks = [peak_live_activations(ops) for ops in sched.ops]
        assert max(peaks) <= vhalf_cap(ranks), (ranks, m, peaks)
        assert result.peak_activations == max(peaks)
        if m >= 2 * ranks:  # the cap binds once enough micro-batches are in flight
            assert max(peaks) == vhalf_cap(ranks), (ranks, m, peaks)


def test_cap_is_the_papers_half_of_1f1b() -> None:
    # (P+2)//2 micro-batches of a rank's share, two half-size stages each; ZB-V's 2P at P <= 2.
    assert [vhalf_cap(p) for p in (1, 2, 3, 4, 8, 16)] == [2, 4, 4, 6, 10, 18]


@pytest.mark.parametrize("ranks", [4, 8])
def test_half_zbv_memory_for_a_bubble_of_about_p_over_2m(ranks: int) -> None:
    m = 4 * ranks
    half = simulate(build_schedule("vhalf", ranks, m), BALANCED)
    zbv = simulate(build_schedule("zbv", ranks, m), BALANCED)
    one = simulate(build_schedule("1f1b", ranks, m), Costs.of(2, 4, 2, 6))  # full-size stages
    assert zbv.peak_activations == 2 * ranks and half.peak_activations == vhalf_cap(ranks)
    assert zbv.makespan <= half.makespan < one.makespan
    work = 3 * 2 * m  # F, B and W of two stages per micro-batch
    assert (half.makespan - work) / work <= ranks / (2 * m) + 0.05


def test_bad_input() -> None:
    with pytest.raises(ScheduleError, match="at least 1 rank"):
        build_schedule("vhalf", 0, 4)
    with pytest.raises(ScheduleError, match="at least 1 micro-batch"):
        build_schedule("vhalf", 4, 0)
