"""Deferred weight grads under saved-tensor hooks (activation offloading, memory meters).

With such hooks ``ctx.saved_tensors`` returns new tensor objects, so a deferral that accumulated
into the saved weight would silently lose the gradient. Both deferrals (the runtime's
``DeferrableLinear`` and the patched Megatron linear) must give the full backward's grads.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dualpipe_megatron.runtime.wgrad import DeferrableLinear, WeightGradStore, deferring

pytestmark = pytest.mark.unit

ROWS, WIDTH = 4, 6


def _identity_hooks() -> contextlib.AbstractContextManager:
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize("hooked", [False, True])
def test_deferrable_linear(hooked: bool) -> None:
    torch.manual_seed(0)
    ref, lin = nn.Linear(WIDTH, WIDTH), DeferrableLinear(WIDTH, WIDTH)
    lin.load_state_dict(ref.state_dict())
    x = torch.randn(ROWS, WIDTH)
    ref(x).square().sum().backward()
    WeightGradStore.clear()
    with _identity_hooks() if hooked else contextlib.nullcontext():
        out = lin(x)
    with deferring("k"):
        out.square().sum().backward()
    assert lin.weight.grad is None
    WeightGradStore.pop("k")
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("hooked", [False, True])
@pytest.mark.parametrize("ddp", [False, True])
def test_megatron_linear(hooked: bool, ddp: bool) -> None:
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication as Linear

    from dualpipe_megatron.megatron.wgrad_megatron import install_linear_deferral

    install_linear_deferral()
    torch.manual_seed(0)
    weight, x = nn.Parameter(torch.randn(WIDTH, WIDTH)), torch.randn(ROWS, WIDTH)

    def run(defer: bool) -> torch.Tensor:
        weight.grad = None
        if ddp:  # Megatron DDP keeps grads in main_grad (its grad hook adds .grad there)
            weight.main_grad = torch.zeros_like(weight)
        WeightGradStore.clear()
        with _identity_hooks() if hooked else contextlib.nullcontext():
            out = Linear.apply(x, weight, None, False, False, False, None, 0, None, 1)
        with deferring("k", enabled=defer):
            out.square().sum().backward()
        if defer:
            WeightGradStore.pop("k")
        if ddp:
            return weight.main_grad + (weight.grad if weight.grad is not None else 0)
        return weight.grad

    full = run(defer=False).clone()
    assert torch.equal(run(defer=True), full)
