"""Deferred weight gradients: the store a ``B(w=false)`` files closures in, and
an ``nn.Linear`` that defers into it without user-written autograd code.

Each :class:`~.executor.Executor` owns a :class:`DeferredWeightGrads` and makes
it the *active* store around every op it runs, so two pipelines in one process
never see each other's closures. Outside any executor a process-wide default
store is active. The active store is a plain module global, not thread-local:
autograd may run a backward on its own worker thread (one per CUDA device), and
what that backward files must still reach the executor waiting on it.

:class:`WeightGradStore` keeps DeepSeek's class-level API (``enabled``/``put``/
``flush``/``pop``/``clear``) over the active store, so autograd functions
written for the reference work unchanged. Every producer (``DeferrableLinear``,
the Megatron patches, user functions) files through it, so one backward's
closures all land in one store under one key. The queue is keyed: the executor
files each backward's closures under the ``(d, s, m)`` the schedule's ``W``
names, and a key-less ``flush``/``pop`` falls back to the reference's FIFO order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as TF
from torch import nn
from torch.autograd import Variable


class DeferredWeightGrads:
    """Weight-gradient closures put aside by input-grad-only backwards, filed by key."""

    def __init__(self) -> None:
        self.enabled = False
        self.cache: list[Callable[[], None]] = []
        self._queue: OrderedDict[Hashable, list[Callable[[], None]]] = OrderedDict()
        self._fifo_ids = itertools.count()

    def put(self, func: Callable[[], None]) -> None:
        """Called by autograd functions (only while ``enabled``) with their weight-grad work."""
        self.cache.append(func)

    def flush(self, key: Hashable | None = None) -> None:
        """File the closures put since the last flush under ``key`` (FIFO slot when ``None``)."""
        if key is None:
            key = ("fifo", next(self._fifo_ids))
        if key in self._queue:
            raise KeyError(f"weight grads of {key} are already pending")
        self._queue[key] = self.cache
        self.cache = []

    def pop(self, key: Hashable | None = None) -> int:
        """Run the closures filed under ``key`` (the oldest when ``None``); return how many ran."""
        if key is None:
            if not self._queue:
                raise KeyError("pop from an empty WeightGradStore")
            _, funcs = self._queue.popitem(last=False)
        else:
            try:
                funcs = self._queue.pop(key)
            except KeyError:
                raise KeyError(f"no deferred weight grads filed under {key}") from None
        for func in funcs:
            func()
        return len(funcs)

    def clear(self) -> None:
        self.enabled = False
        self.cache = []
        self._queue = OrderedDict()

    def pending(self) -> list[Hashable]:
        """Keys whose weight grads are filed but not yet run."""
        return list(self._queue)

    @contextmanager
    def activated(self) -> Iterator[None]:
        """Make this the store :class:`WeightGradStore` and :func:`deferring` use, until exit."""
        global _active
        previous, _active = _active, self
        try:
            yield
        finally:
            _active = previous


_active = DeferredWeightGrads()


class _ActiveEnabled(type):
    """``WeightGradStore.enabled`` is a class attribute in DeepSeek's API: read and set the
    active store's flag through it."""

    @property
    def enabled(cls) -> bool:
        return _active.enabled

    @enabled.setter
    def enabled(cls, value: bool) -> None:
        _active.enabled = value


class WeightGradStore(metaclass=_ActiveEnabled):
    """DeepSeek's class-level store, routed to the active :class:`DeferredWeightGrads`."""

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        _active.put(func)

    @classmethod
    def flush(cls, key: Hashable | None = None) -> None:
        _active.flush(key)

    @classmethod
    def pop(cls, key: Hashable | None = None) -> int:
        return _active.pop(key)

    @classmethod
    def clear(cls) -> None:
        _active.clear()

    @classmethod
    def pending(cls) -> list[Hashable]:
        return _active.pending()


@contextmanager
def deferring(key: Hashable, enabled: bool = True) -> Iterator[None]:
    """Run a backward with weight grads deferred into the active store, filed under ``key``.

    With ``enabled=False`` it is a no-op, so callers need no branch.
    """
    if not enabled:
        yield
        return
    store = _active
    store.enabled = True
    try:
        yield
    finally:
        store.enabled = False
    store.flush(key)


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


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a linear in on ``device_type`` now; ``None`` when it is off (or
    the device type has no autocast, e.g. meta)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def _autocast_as(device_type: str, dtype: torch.dtype | None) -> AbstractContextManager:
    """The autocast state a forward recorded. ``torch.amp.custom_bwd`` restores it for a custom
    function's backward; the deferred weight grads a ``W`` runs later need it just as much.
    Entered only when the state differs: entering one costs about what a small linear's
    backward does."""
    if _autocast_dtype(device_type) == dtype:  # always so where autocast is unavailable (meta)
        return nullcontext()
    return torch.autocast(device_type, dtype=dtype, enabled=dtype is not None)


def _autocast_input(input: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The copy of ``input`` autocast hands ``F.linear`` (and ``nn.Linear``'s graph saves)."""
    if dtype is None or not input.is_floating_point() or input.dtype == torch.float64:
        return input
    return input.to(dtype)


def _weight_grads(
    weight: torch.Tensor, bias: torch.Tensor | None, grad2d: torch.Tensor, input2d: torch.Tensor,
    need_weight: bool, need_bias: bool, device_type: str, dtype: torch.dtype | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight and bias grads autograd gives ``nn.Linear``: addmm's backward with the same
    kernels in the forward's compute dtype, then autocast's cast back to each parameter's dtype."""
    with _autocast_as(device_type, dtype):
        gw = grad2d.t().mm(input2d).to(weight.dtype) if need_weight else None
        # dtype pinned: nn.Linear's bias grad is a sum in the compute dtype, not autocast's
        # float32 sum (CUDA's policy for a bare sum).
        gb = grad2d.sum(0, dtype=grad2d.dtype).to(bias.dtype) if need_bias else None
    return gw, gb


def _deferred_weight_grads(
    weight: torch.Tensor, bias: torch.Tensor | None, grad2d: torch.Tensor, input2d: torch.Tensor,
    need_weight: bool, need_bias: bool, device_type: str, dtype: torch.dtype | None,
) -> None:
    gw, gb = _weight_grads(weight, bias, grad2d, input2d, need_weight, need_bias, device_type, dtype)
    if gw is not None:
        _accumulate(weight, gw)
    if gb is not None:
        _accumulate(bias, gb)


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` whose weight/bias grads go to :class:`WeightGradStore` when it is enabled.

    Under autocast it computes what ``nn.Linear`` does (input, weight and bias in the autocast
    dtype, grads cast back to the parameters' dtypes); its backward and deferred weight grads run
    with the forward's autocast state, whatever state is active when they run.
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.device_type = input.device.type
        ctx.autocast_dtype = _autocast_dtype(ctx.device_type)
        input = _autocast_input(input, ctx.autocast_dtype)
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
        grad_input = None
        if need_input:
            # Autocast casts the weight as in forward; the engine casts this grad to the input's dtype.
            with _autocast_as(ctx.device_type, ctx.autocast_dtype):
                grad_input = grad2d.mm(weight).view(input.shape)
        if not (need_weight or need_bias):
            return grad_input, None, None
        input2d = input.reshape(-1, input.shape[-1])
        args = (weight, ctx.bias, grad2d, input2d, need_weight, need_bias,
                ctx.device_type, ctx.autocast_dtype)
        if WeightGradStore.enabled:
            WeightGradStore.put(partial(_deferred_weight_grads, *args))
            return grad_input, None, None
        return grad_input, *_weight_grads(*args)


class DeferrableLinear(nn.Linear):
    """``nn.Linear`` whose weight grads can be deferred to a schedule's ``W``.

    Same parameters and state dict; outside a deferred backward its grads are
    the ones ``nn.Linear`` gets, with or without autocast.
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
    "DeferrableLinear", "DeferredWeightGrads", "WeightGradStore", "deferring", "make_linears_deferrable",
    "run_backward",
]
