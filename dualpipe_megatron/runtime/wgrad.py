"""Deferred weight gradients: the store a ``B(w=false)`` files closures in, and
an ``nn.Linear`` that defers into it without user-written autograd code.

The store keeps DeepSeek's class-level API (``enabled``/``put``/``flush``/``pop``/
``clear``), so autograd functions written for the reference work unchanged. Its
queue is keyed: the executor files each backward's closures under the
``(d, s, m)`` the schedule's ``W`` names, and a key-less ``flush``/``pop`` falls
back to the reference's FIFO order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as TF
from torch import nn
from torch.autograd import Variable


class WeightGradStore:
    """Weight-gradient closures put aside by input-grad-only backwards."""

    enabled: bool = False
    cache: list[Callable[[], None]] = []
    _queue: "OrderedDict[Hashable, list[Callable[[], None]]]" = OrderedDict()
    _fifo_ids: Iterator[int] = itertools.count()

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        """Called by autograd functions (only while ``enabled``) with their weight-grad work."""
        cls.cache.append(func)

    @classmethod
    def flush(cls, key: Hashable | None = None) -> None:
        """File the closures put since the last flush under ``key`` (FIFO slot when ``None``)."""
        if key is None:
            key = ("fifo", next(cls._fifo_ids))
        if key in cls._queue:
            raise KeyError(f"weight grads of {key} are already pending")
        cls._queue[key] = cls.cache
        cls.cache = []

    @classmethod
    def pop(cls, key: Hashable | None = None) -> int:
        """Run the closures filed under ``key`` (the oldest when ``None``); return how many ran."""
        if key is None:
            if not cls._queue:
                raise KeyError("pop from an empty WeightGradStore")
            _, funcs = cls._queue.popitem(last=False)
        else:
            try:
                funcs = cls._queue.pop(key)
            except KeyError:
                raise KeyError(f"no deferred weight grads filed under {key}") from None
        for func in funcs:
            func()
        return len(funcs)

    @classmethod
    def clear(cls) -> None:
        cls.enabled = False
        cls.cache = []
        cls._queue = OrderedDict()

    @classmethod
    def pending(cls) -> list[Hashable]:
        """Keys whose weight grads are filed but not yet run."""
        return list(cls._queue)


@contextmanager
def deferring(key: Hashable, enabled: bool = True) -> Iterator[None]:
    """Run a backward with weight grads deferred and file them under ``key``.

    With ``enabled=False`` it is a no-op, so callers need no branch.
    """
    if not enabled:
        yield
        return
    WeightGradStore.enabled = True
    try:
        yield
    finally:
        WeightGradStore.enabled = False
    WeightGradStore.flush(key)


def run_backward(tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor | None]) -> None:
    """Backward from ``tensors`` straight through the engine.

    ``torch.autograd.backward`` checks each grad against its tensor's current
    shape, which fails once a sent output's storage has been freed; the engine
    itself only needs the grad_fn's recorded metadata.
    """
    Variable._execution_engine.run_backward(
        tuple(tensors), tuple(grad_tensors),
        keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True,
    )


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """What autograd's AccumulateGrad does for a dense grad outside grad mode."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad


def _weight_grads(
    grad2d: torch.Tensor, input2d: torch.Tensor, need_weight: bool, need_bias: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and bias grads autograd's addmm backward computes, with the same kernels."""
    gw = grad2d.t().mm(input2d) if need_weight else None
    gb = grad2d.sum(0) if need_bias else None
    return gw, gb


def _deferred_weight_grads(
    weight: torch.Tensor, bias: torch.Tensor | None, grad2d: torch.Tensor, input2d: torch.Tensor,
    need_weight: bool, need_bias: bool,
) -> None:
    gw, gb = _weight_grads(grad2d, input2d, need_weight, need_bias)
    if gw is not None:
        _accumulate(weight, gw)
    if gb is not None:
        _accumulate(bias, gb)


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose weight/bias grads go to :class:`WeightGradStore` when it is enabled."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(input)
        # The parameters themselves, not saved copies: under saved-tensor hooks (offloading,
        # memory meters) ``saved_tensors`` gives back new tensor objects, and a deferred grad
        # accumulated into one of those would be lost.
        ctx.weight, ctx.bias = weight, bias
        return TF.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (input,) = ctx.saved_tensors
        weight = ctx.weight
        need_input, need_weight, need_bias = ctx.needs_input_grad
        grad2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = grad2d.mm(weight).view(input.shape) if need_input else None
        if not (need_weight or need_bias):
            return grad_input, None, None
        input2d = input.reshape(-1, input.shape[-1])
        if WeightGradStore.enabled:
            WeightGradStore.put(
                partial(_deferred_weight_grads, weight, ctx.bias, grad2d, input2d, need_weight, need_bias)
            )
            return grad_input, None, None
        gw, gb = _weight_grads(grad2d, input2d, need_weight, need_bias)
        return grad_input, gw, gb


class DeferrableLinear(nn.Linear):
    """``nn.Linear`` whose weight grads can be deferred to a schedule's ``W``.

    Same parameters and state dict; outside a deferred backward its grads are
    the ones ``nn.Linear`` gets.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _LinearFunction.apply(input, self.weight, self.bias)


def make_linears_deferrable(module: nn.Module) -> int:
    """Turn every plain ``nn.Linear`` inside ``module`` into a :class:`DeferrableLinear`.

    Swaps the class in place (parameters, hooks and state dict stay); subclasses
    with their own ``forward`` are left alone. Returns how many were swapped.
    """
    swapped = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.__class__ = DeferrableLinear
            swapped += 1
    return swapped


__all__ = [
    "DeferrableLinear", "WeightGradStore", "deferring", "make_linears_deferrable", "run_backward",
]
