"""What one training job's DualPipe schedule keeps between steps, and its step-end actions.

:class:`DualPipeJob` is owned by the job's :class:`~.schedule.DualPipeOptions` (configuration
only; ``options.job`` is its one handle, so that ``prepare_model`` and every
``make_forward_backward_func(options)`` call reach the same job). Step-end actions add gradients
computed outside the chunks' parameters into them (EPLB's expert replicas): ``finish_step`` runs
them, in registration order, on every rank before any of the step's gradients is summed across
ranks (tied embedding, DualPipe's mirrored copies, data parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch.distributed as dist
from torch import nn

from ..runtime.executor import StepStats
from ..trace.recorder import OpTracer

StepEndAction = Callable[[Sequence[nn.Module]], None]  # called with the rank's model chunks


@dataclass(eq=False)
class DualPipeJob:
    """One job's schedule state, set by the adapter (not by users), and its step-end actions."""

    prepared: bool = False  # prepare_model ran (ties, mirrors, weight-grad patches)
    mirror_group: dist.ProcessGroup | None = None  # DualPipe only, from prepare_model
    last_stats: StepStats | None = None  # the executor's counters of the latest step
    w_split_announced: bool = False  # the first training step said what its W ops ran (without the overlap)
    plans: dict = field(default_factory=dict)  # (ranks, M, forward_only, rank) -> (schedule, plan)
    schedules: dict = field(default_factory=dict)  # (ranks, M) -> the schedule the steps run
    tracer: OpTracer | None = None  # created on the first step when tracing
    report_layouts: dict = field(default_factory=dict)  # (direction, M, forward_only) -> layout sent (relay.py)
    step_end: list[StepEndAction] = field(default_factory=list)

    def add_step_end(self, action: StepEndAction) -> None:
        self.step_end.append(action)

    def remove_step_end(self, action: StepEndAction) -> None:
        """Remove exactly ``action`` (by identity); raises ``ValueError`` if it is not registered."""
        for i, registered in enumerate(self.step_end):
            if registered is action:
                del self.step_end[i]
                return
        raise ValueError(f"step-end action {action!r} is not registered on this job")

    def run_step_end(self, chunks: Sequence[nn.Module]) -> None:
        for action in self.step_end:
            action(chunks)


__all__ = ["DualPipeJob", "StepEndAction"]
