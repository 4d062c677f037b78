"""research/periodic_family.py: the dynamic program over neighbour links finds the least rank-0
lifetimes of its family, as a brute force over every pair of cycles and phase offset at P = 2
finds them op by op (:func:`walk`), and at DeepSeek's period it lands on DeepSeek's peak."""

from __future__ import annotations

import itertools

import pytest
from periodic_family import Durations, Found, cycles, least_rank0_lifetimes, walk  # research/: conftest.py

pytestmark = pytest.mark.unit

TENTHS = Durations(f=10, b=15, w=5, pair=19)  # F 1, B(w=false) 1.5, W 0.5, F&B pair 1.9


def rank0(chain: tuple[list[int], list[int]]) -> int:
    """Rank 0's two lifetimes (stage 0's and stage 2P - 1's) from :func:`walk`'s F starts and W ends."""
    f_start, w_end = chain
    return w_end[0] - f_start[0] + w_end[-1] - f_start[-1]


@pytest.mark.parametrize("period", [48, 49])
def test_the_links_sum_is_the_brute_force_least(period: int) -> None:
    found = least_rank0_lifetimes(2, period, TENTHS)
    assert rank0(walk(found, period)) == found.lifetimes
    every = cycles(TENTHS, period)
    brute = min(rank0(walk(Found(0, [a, b], [0, shift]), period))
                for a, b in itertools.product(every, every) for shift in range(period))
    assert brute == found.lifetimes


def test_at_deepseeks_period_rank_0_holds_deepseeks_peak() -> None:
    """Every rank pairing both its F's (T = 4.8, as DeepSeek's steady state): rank 0's least
    average live count is 2P + 1, DeepSeek's peak."""
    found = least_rank0_lifetimes(4, 48, TENTHS)
    assert found.lifetimes == 9 * 48
    assert all(c.pairs == 2 for c in found.cycles)
