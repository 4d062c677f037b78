"""Record the runtime's real p2p calls for a schedule without processes, and check them.

Every rank's :class:`Executor` runs in this process, one after another, with
tiny stages over a :class:`DryTransport` (receives read zeros, nothing waits),
so the log holds exactly the posts and waits the real posting logic makes.
The NCCL model then decides whether those calls, made by all ranks at once,
could deadlock. The sweep does this for every generator over a grid of sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Iterator

import torch
from torch import nn

from ..schedules import ScheduleError, build_schedule
from .executor import Executor
from .handlers import ModuleHandlers, StepData
from .nccl_model import Verdict
from .p2p import DryTransport, P2P
from .plan import MessagePlan
from .strict import check_both_queue_models
from .wgrad import make_linears_deferrable, run_backward

WIDTH = 2


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class _HookedStage(_Stage):
    """A stage class with DeepSeek's F&B hook, so FB ops take the executor's overlapped path."""

    @classmethod
    def overlapped_forward_backward(
        cls, module0: nn.Module, inputs0: list, criterion0: Any, labels0: list, module1: nn.Module,
        loss1: torch.Tensor | None, outputs1: list[torch.Tensor], grads1: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        run_backward([loss1] if loss1 is not None else outputs1,
                     [torch.ones_like(loss1)] if loss1 is not None else grads1)
        return outputs0, loss0


@dataclass(frozen=True)
class Case:
    """One configuration of the sweep."""

    schedule: str
    ranks: int
    microbatches: int
    forward_only: bool = False
    wgrad_split: bool = True
    overlap_hook: bool = True

    def __str__(self) -> str:
        mode = "forward-only" if self.forward_only else "training"
        return (f"{self.schedule} P={self.ranks} M={self.microbatches} {mode} "
                f"wgrad-split={'on' if self.wgrad_split else 'off'} hook={'on' if self.overlap_hook else 'off'}")


def record(case: Case) -> dict[int, list[dict[str, Any]]]:
    """Each rank's p2p calls for one step of ``case`` (rank -> events)."""
    sched = build_schedule(case.schedule, case.ranks, case.microbatches)
    stage_cls = _HookedStage if case.overlap_hook else _Stage
    count = sched.microbatches_per_direction
    programs = {}
    for rank in range(sched.ranks):
        plan = MessagePlan.build(sched, rank, case.forward_only)
        chunks = {}
        for ds in sched.stages_on(rank):
            chunks[ds] = stage_cls()
            make_linears_deferrable(chunks[ds])
        p2p = P2P(DryTransport(), rank, torch.device("cpu"), lambda edge: [(1, WIDTH)], torch.float32,
                  timeout=1.0, strict=False, record=True)
        inputs = {d: [(torch.ones(1, WIDTH),)] * count for d in range(sched.directions)}
        labels = {d: [()] * count for d in range(sched.directions)}
        data = StepData(inputs, labels, lambda out: out.sum(), False)
        executor = Executor(sched, rank, ModuleHandlers(chunks, data, sched.stages - 1), p2p,
                            defer_weight_grads=case.wgrad_split, use_overlap_hook=case.overlap_hook)
        with torch.set_grad_enabled(not case.forward_only):
            executor.run(plan, case.forward_only)
        assert p2p.log is not None
        programs[rank] = p2p.log.events
    return programs


def check_case(case: Case) -> list[Verdict]:
    """The model's failed verdicts for ``case`` (empty: no deadlock possible)."""
    return check_both_queue_models(record(case), warm=set())


def sweep_cases(schedules: list[str], ranks: list[int]) -> Iterator[Case]:
    """Every valid case for M in {2P, 2P+1 (else 2P+2), 4P}: training with the W split and the
    F&B hook each on and off, and forward-only (which runs neither backward nor pairs)."""
    for name, p in product(schedules, ranks):
        for m in _microbatch_counts(name, p):
            for split, hook in product((True, False), (True, False)):
                yield Case(name, p, m, False, split, hook)
            yield Case(name, p, m, True)


def _microbatch_counts(name: str, p: int) -> list[int]:
    valid = []
    for options in ((2 * p,), (2 * p + 1, 2 * p + 2), (4 * p,)):
        for m in options:
            try:
                build_schedule(name, p, m)
            except ScheduleError:
                continue
            if m not in valid:
                valid.append(m)
            break
    return valid


__all__ = ["Case", "check_case", "record", "sweep_cases"]
