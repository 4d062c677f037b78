"""The activation meter behind `make bench`'s "peak activation bytes" column.

Hand-countable cases: a chain of linears saves its inputs (float32, known sizes), parameters are
never counted, a storage shared by two saved tensors counts once, backward releases everything,
and a deferred weight-grad closure keeps its tensors counted until its W runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from activation_meter import ActivationMeter  # noqa: E402

from dualpipe_megatron.runtime.wgrad import DeferrableLinear, WeightGradStore, deferring  # noqa: E402

pytestmark = pytest.mark.unit

ROWS, WIDTH = 8, 16
BYTES = ROWS * WIDTH * 4  # one float32 activation


def _chain(depth: int, cls: type[nn.Linear] = nn.Linear) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[cls(WIDTH, WIDTH, bias=False) for _ in range(depth)])


def test_saved_inputs_counted_parameters_not_and_backward_releases() -> None:
    model = _chain(3)
    meter = ActivationMeter(model.parameters())
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with meter.measuring():
        out = model(x)
        assert meter.live == 3 * BYTES  # each linear saves its input; weights are excluded
        out.sum().backward()
    assert meter.live == 0 and meter.peak == 3 * BYTES


def test_a_storage_saved_twice_counts_once() -> None:
    meter = ActivationMeter([])
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with meter.measuring():
        y = x * x  # saves x twice
        assert meter.live == BYTES
        del y
    assert meter.live == 0 and meter.peak == BYTES


def test_deferred_weight_grads_stay_counted_until_their_w() -> None:
    model = _chain(2, DeferrableLinear)
    meter = ActivationMeter(model.parameters())
    WeightGradStore.clear()
    with meter.measuring():
        out = model(torch.randn(ROWS, WIDTH, requires_grad=True))
        with deferring("k"):
            out.sum().backward()
        held = meter.live
        WeightGradStore.pop("k")
    assert held > 0 and meter.live == 0
    assert all(p.grad is not None for p in model.parameters())


def test_the_timeline_records_live_bytes_after_every_change() -> None:
    model = _chain(2)
    meter = ActivationMeter(model.parameters(), timeline=True)
    with meter.measuring():
        model(torch.randn(ROWS, WIDTH, requires_grad=True)).sum().backward()
    times = [t for t, _ in meter.timeline]
    assert [live for _, live in meter.timeline] == [BYTES, 2 * BYTES, BYTES, 0] and times == sorted(times)
    assert ActivationMeter([]).timeline is None  # off unless asked for


def test_a_held_storage_freed_in_place_stops_counting() -> None:
    """Megatron's output-discarding checkpoint frees a saved output with ``resize_(0)``."""
    meter = ActivationMeter([])
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    with meter.measuring():
        y = x.exp()  # saves its output
        assert meter.live == BYTES
        y.untyped_storage().resize_(0)
        assert meter.live == 0
        del y
    assert meter.live == 0 and meter.peak == BYTES
