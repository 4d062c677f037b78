"""``DeferrableLinear`` under autocast computes what ``nn.Linear`` does, bit for bit.

Forward runs under CPU autocast; backward inside or outside it (ordinary training code runs
``loss.backward()`` outside); weight grads at once or deferred to a ``W`` that runs outside
autocast. Also DualPipeV through the compat API under bf16 autocast on 2 gloo ranks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import autocast_workers as aw
from launcher import spawn
from dualpipe_megatron.runtime.wgrad import DeferredWeightGrads, deferring, make_linears_deferrable

pytestmark = pytest.mark.multiprocess


def _cpu_autocast_supports(dtype: torch.dtype) -> bool:
    """Torch warns and runs without autocast for a dtype its CPU autocast does not support."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=dtype):
            return torch.is_autocast_enabled("cpu")


DTYPES = [
    torch.bfloat16,
    pytest.param(torch.float16, marks=pytest.mark.skipif(
        not _cpu_autocast_supports(torch.float16), reason="this torch has no float16 CPU autocast")),
]


def _model() -> nn.Module:
    """Two linears: the first gets a float32 input, the second the autocast dtype."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 6, bias=False), nn.LayerNorm(6))


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7)])
@pytest.mark.parametrize("backward_in_autocast", [True, False])
@pytest.mark.parametrize("defer", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_deferrable_linear_is_bitwise_nn_linear_under_autocast(
    dtype: torch.dtype, defer: bool, backward_in_autocast: bool, shape: tuple[int, ...]
) -> None:
    ref = _model()
    mod = copy.deepcopy(ref)
    assert make_linears_deferrable(mod) == 2
    store = DeferredWeightGrads()
    x = torch.randn(*shape, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()

    def backward_context() -> contextlib.AbstractContextManager:
        return torch.autocast("cpu", dtype=dtype) if backward_in_autocast else contextlib.nullcontext()

    for step in range(2):  # two micro-batches: the second accumulates onto the first
        with torch.autocast("cpu", dtype=dtype):
            want = ref(x)
            got = mod(x2)
        assert torch.equal(got, want), f"step {step}: outputs differ"
        with backward_context():
            want.square().sum().backward()
        with store.activated(), backward_context(), deferring(step, enabled=defer):
            got.square().sum().backward()
    if defer:
        linears = [m for m in mod if isinstance(m, nn.Linear)]
        assert all(p.grad is None for m in linears for p in m.parameters()), "weight grads were not deferred"
        assert store.pop(0) == 2 and store.pop(1) == 2  # W ops, outside autocast
    assert x2.grad.dtype == torch.float32 and torch.equal(x2.grad, x.grad)
    for (name, p), q in zip(ref.named_parameters(), mod.parameters(), strict=True):
        assert q.grad.dtype == p.dtype == torch.float32, name
        assert torch.equal(q.grad, p.grad), name


@functools.cache
def compat_launched() -> list[dict[str, Any]]:
    """DualPipeV through the compat API under bf16 autocast, launched once for the three checks below."""
    return spawn(2, aw.dualpipev_autocast)


def test_dualpipev_compat_under_bf16_autocast_loss_matches_one_process() -> None:
    """Bitwise: the same kernels on the same micro-batches."""
    for rank, got in enumerate(compat_launched()):
        if rank == 0:
            assert got["loss"].dtype == torch.float32 and torch.equal(got["loss"], got["ref_loss"])
        else:
            assert got["loss"] is None, f"rank {rank} returned a loss"


def test_dualpipev_compat_under_bf16_autocast_defers_weight_grads() -> None:
    for rank, got in enumerate(compat_launched()):
        assert got["deferred"] > 0, f"rank {rank}: no weight grad was deferred"


def test_dualpipev_compat_under_bf16_autocast_grads_match_one_process() -> None:
    """Bitwise: grads summed in the same order as one process."""
    for rank, got in enumerate(compat_launched()):
        for i, (g, want) in enumerate(zip(got["grads"], got["ref_grads"], strict=True)):
            assert g.dtype == torch.float32 and torch.equal(g, want), f"rank {rank} param {i}"
