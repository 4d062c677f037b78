"""What computes each op: the handlers an :class:`~.executor.Executor` calls, and DeepSeek's API as one client.

The executor walks a rank's plan, moves the messages and keeps each (d, s, m)'s
tensors between its F and its B/W; every computation is a call to a
:class:`StageHandlers` with the op (its key names the stage and the micro-batch),
as ``torch.distributed.pipelining``'s ``register_custom_function`` lets a
runtime replace one op kind's computation. :class:`ModuleHandlers` is the
DeepSeek API's handler set (stage modules called with their inputs, a criterion
on the last stage, autograd backward, the ``overlapped_forward_backward`` hook);
the Megatron adapter registers its own (``megatron/stages.py``, ``moe_overlap.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..schedules.ir import B, F, Key, W
from .wgrad import DeferredWeightGrads, run_backward

# A forward's result: the stage outputs (what the next stage receives) and, on a last stage, the
# loss its backward starts from (``None`` elsewhere or without a criterion).
Forwarded = tuple[list[torch.Tensor], torch.Tensor | None]


class StageHandlers:
    """The computations of one rank's ops; the executor calls them with each op.

    The executor runs :meth:`backward` with weight grads deferred into its store when the B
    has ``w:false`` (see :mod:`.wgrad`), and reads the input grads from the inputs' ``.grad``
    afterwards; :meth:`pair` runs only for FB ops :meth:`pairs` accepts.
    """

    def first_inputs(self, key: Key) -> list[Any]:
        """Inputs of micro-batch ``key.m`` on a direction's first stage, where nothing is received."""
        return []

    def forward(self, key: Key, inputs: list[Any]) -> Forwarded:
        """F of ``key`` on ``inputs`` (received, or :meth:`first_inputs`)."""
        raise NotImplementedError

    def backward(self, half: B, inputs: list[Any], loss: torch.Tensor | None, outputs: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        """B of ``half.key``: from ``loss`` on a last stage, else from ``outputs`` with their ``grads``."""
        raise NotImplementedError

    def weight(self, half: W, store: DeferredWeightGrads) -> int:
        """W of ``half.key``: run what its B deferred into ``store``; returns how many closures ran."""
        return store.pop(half.key)

    def pairs(self, f: F, b: B) -> bool:
        """Whether the FB op of ``f`` and ``b`` runs as one :meth:`pair` (else F, then B)."""
        return False

    def pair(self, f: F, inputs0: list[Any], b: B, inputs1: list[Any], loss1: torch.Tensor | None,
             outputs1: list[torch.Tensor], grads1: list[torch.Tensor]) -> Forwarded:
        """F of ``f.key`` together with B of ``b.key`` (arguments as for :meth:`forward` and :meth:`backward`)."""
        raise NotImplementedError


@dataclass
class StepData:
    """One step's data for :class:`ModuleHandlers`, split into micro-batches.

    ``inputs[d][m]`` feeds micro-batch ``m`` of direction ``d`` where this rank
    holds its first stage; ``labels[d][m]`` goes to the criterion where it holds
    its last stage.
    """

    inputs: dict[int, list[tuple[Any, ...]]]
    labels: dict[int, list[tuple[Any, ...]]]
    criterion: Callable[..., torch.Tensor] | None
    return_outputs: bool


@dataclass
class StepResult:
    """Per direction ending on this rank: micro-batch losses and (if asked) outputs."""

    losses: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)
    outputs: dict[int, dict[int, list[torch.Tensor]]] = field(default_factory=dict)


def as_list(outputs: Any) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


def has_overlap_hook(module0: nn.Module, module1: nn.Module) -> bool:
    """DeepSeek's rule: both chunks of one class that defines ``overlapped_forward_backward``."""
    return type(module0) is type(module1) and hasattr(type(module0), "overlapped_forward_backward")


class ModuleHandlers(StageHandlers):
    """DeepSeek's API: stage modules ``modules[(d, s)]`` called with their inputs, the criterion
    on the outputs of stage ``last_stage`` with the labels, autograd backward, and F&B pairs
    through the modules' ``overlapped_forward_backward`` hook. :attr:`result` collects the
    losses (and outputs, if asked) where a direction ends."""

    def __init__(self, modules: Mapping[tuple[int, int], nn.Module], data: StepData, last_stage: int) -> None:
        self.modules, self.data, self.last_stage = modules, data, last_stage
        self.result = StepResult()

    def first_inputs(self, key: Key) -> list[Any]:
        return list(self.data.inputs[key.d][key.m])

    def _criterion(self, key: Key) -> tuple[Callable | None, tuple]:
        """The criterion and labels of ``key``'s outputs (none before the last stage)."""
        if key.s != self.last_stage or self.data.criterion is None:
            return None, ()
        return self.data.criterion, self.data.labels[key.d][key.m]

    def _record(self, key: Key, outputs: list[torch.Tensor], loss: torch.Tensor | None) -> None:
        if key.s != self.last_stage:
            return
        if loss is not None:
            self.result.losses.setdefault(key.d, {})[key.m] = loss.detach()
        if self.data.return_outputs:
            self.result.outputs.setdefault(key.d, {})[key.m] = [o.detach() for o in outputs]

    def forward(self, key: Key, inputs: list[Any]) -> Forwarded:
        outputs = as_list(self.modules[(key.d, key.s)](*inputs))
        criterion, labels = self._criterion(key)
        loss = criterion(*outputs, *labels) if criterion is not None else None
        self._record(key, outputs, loss)
        return outputs, loss

    def backward(self, half: B, inputs: list[Any], loss: torch.Tensor | None, outputs: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        if loss is not None:
            run_backward([loss], [torch.ones_like(loss)])
        elif outputs:
            run_backward(outputs, grads)

    def pairs(self, f: F, b: B) -> bool:
        return has_overlap_hook(self.modules[(f.key.d, f.key.s)], self.modules[(b.key.d, b.key.s)])

    def pair(self, f: F, inputs0: list[Any], b: B, inputs1: list[Any], loss1: torch.Tensor | None,
             outputs1: list[torch.Tensor], grads1: list[torch.Tensor]) -> Forwarded:
        module0, module1 = self.modules[(f.key.d, f.key.s)], self.modules[(b.key.d, b.key.s)]
        criterion0, labels0 = self._criterion(f.key)
        outputs0, loss0 = type(module0).overlapped_forward_backward(
            module0, inputs0, criterion0, list(labels0), module1, loss1, outputs1, grads1,
        )
        outputs0 = as_list(outputs0)
        self._record(f.key, outputs0, loss0)
        return outputs0, loss0


__all__ = ["Forwarded", "ModuleHandlers", "StageHandlers", "StepData", "StepResult", "as_list", "has_overlap_hook"]
