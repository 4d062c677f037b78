"""Weight-gradient split through Megatron's delayed wgrad (``--delay-wgrad-compute``, TE layers).

With ``config.delay_wgrad_compute`` Transformer Engine's linears keep each backward's weight
GEMM in a per-module FIFO until ``backward_dw()`` pops it, and Megatron's fine-grained schedule
plans call ``backward_dw`` of every layer slot (``TransformerLayerNode.backward_dw``) right after
that slot's backward, inside ``TransformerModelChunkSchedulePlan.run``. We patch that one method:
while the runtime's :class:`WeightGradStore` is enabled (a ``B`` with ``w:false``), the slot's
``backward_dw`` is filed for the schedule's ``W`` instead of running. The slot's post-backward
hook, which Megatron fires after ``backward_dw`` in this mode, moves with it.

Two conditions keep this exact, both checked by
:func:`dualpipe_megatron.megatron.refusals.delayed_wgrad_problems`:

- every backward must go through a plan (our MoE F&B overlap on), since a plain autograd
  backward of a TE layer would leave its weight GEMM queued with nobody to pop it;
- per chunk, weight grads must complete in the order the backwards ran, because TE's queue is
  FIFO: a later ``backward_dw`` pops the oldest pending GEMM of that module.

Local (non-TE) linears keep their own deferral (:mod:`.wgrad_megatron`); their
``backward_dw`` is a no-op either way.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any, Callable

from ..patch_guard import PatchSet
from ..runtime.wgrad import WeightGradStore
from ..schedules import B, Schedule, W
from ..schedules.ir import halves
from .guard import check_version

PATCHES = PatchSet("delayed-wgrad deferral")
_original: dict[str, Callable] = {}


def _backward_dw(node: Any) -> None:
    if WeightGradStore.enabled and node.delay_wgrad_compute:
        WeightGradStore.put(partial(_original["backward_dw"], node))
        return
    _original["backward_dw"](node)


def install_delayed_wgrad_deferral() -> None:
    """Patch ``TransformerLayerNode.backward_dw`` (once; guarded like every patch)."""
    check_version()
    from megatron.core.models.common.utils import TransformerLayerNode

    original = TransformerLayerNode.backward_dw
    if PATCHES.patch(TransformerLayerNode, "backward_dw", _backward_dw, "(self)"):
        _original["backward_dw"] = original


def uninstall_delayed_wgrad_deferral() -> None:
    """Put Megatron's own ``backward_dw`` back."""
    PATCHES.restore()
    _original.clear()


def fifo_order_violations(sched: Schedule, rank: int) -> list[str]:
    """Weight grads of ``rank`` that would complete out of their chunk's backward order."""
    pending: dict[tuple[int, int], deque] = {}
    problems = []
    for index, op in enumerate(sched.ops[rank]):
        for half in halves(op):
            stage = (half.key.d, half.key.s)
            if isinstance(half, B):
                pending.setdefault(stage, deque()).append(half.key)
                if not half.w:
                    continue
            elif not isinstance(half, W):
                continue
            oldest = pending[stage].popleft()
            if oldest != half.key:
                problems.append(f"op {index} completes the weight grad of {half.key} while {oldest} "
                                f"is older on the same chunk")
    return problems


__all__ = ["PATCHES", "fifo_order_violations",
           "install_delayed_wgrad_deferral", "uninstall_delayed_wgrad_deferral"]
