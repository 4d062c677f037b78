"""Every pipeline rank runs the same plan, or none does.

Each rank builds the whole schedule itself (and, with an optimized order, optimizes it from its
own copy of the stage costs). Ranks that disagree would exchange messages for other micro-batches
and compute on the wrong activations without any error. So before the first step of each new
program (a new micro-batch count, a forward-only step) the ranks all-gather a digest of the whole
schedule they built: one small collective per program, none per step. On a difference every rank
raises :class:`PlanMismatchError` before any pipeline message, naming the first differing op.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..schedules.ir import Schedule


class PlanMismatchError(RuntimeError):
    """The pipeline ranks built different schedules (raised on every rank, before any message)."""


def plan_digest(sched: Schedule, forward_only: bool) -> bytes:
    """SHA-256 of the schedule's JSON contract form and the step kind."""
    text = sched.to_json() + ("|forward-only" if forward_only else "|training")
    return hashlib.sha256(text.encode()).digest()


def _first_difference(mine: Schedule, theirs: Schedule) -> str:
    """The first place where two ranks' schedules differ, in words."""
    for field in ("name", "ranks", "stages", "microbatches", "directions"):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            return f"{field} {a!r} vs {b!r}"
    for rank, (ops_a, ops_b) in enumerate(zip(mine.ops, theirs.ops)):
        for index, (a, b) in enumerate(zip(ops_a, ops_b)):
            if a != b:
                return f"pipeline rank {rank}'s op {index}: {a} vs {b}"
        if len(ops_a) != len(ops_b):
            return f"pipeline rank {rank} has {len(ops_a)} vs {len(ops_b)} ops"
    return "the placement of stages on ranks" if mine.placement != theirs.placement else "the step kind"


def check_plan_agreement(sched: Schedule, forward_only: bool, group: dist.ProcessGroup,
                         device: torch.device) -> None:
    """Collective over ``group``: raise :class:`PlanMismatchError` on every rank unless all ranks
    built this exact schedule for this kind of step."""
    digest = torch.tensor(list(plan_digest(sched, forward_only)), dtype=torch.uint8, device=device)
    every = [torch.empty_like(digest) for _ in range(group.size())]
    dist.all_gather(every, digest, group=group)
    if all(torch.equal(d, every[0]) for d in every):
        return
    # Rare and fatal: gather the schedules themselves to say where they differ.
    texts: list = [None] * group.size()
    dist.all_gather_object(texts, sched.to_json(), group=group)
    scheds = [Schedule.from_json_obj(json.loads(t)) for t in texts]
    odd = [r for r in range(group.size()) if not torch.equal(every[r], every[0])]
    raise PlanMismatchError(
        f"pipeline ranks built different plans: ranks {odd} differ from rank 0 ({sched.name}, "
        f"M={sched.microbatches}); first difference, rank 0 vs rank {odd[0]}: "
        f"{_first_difference(scheds[0], scheds[odd[0]])}. Every rank must build the same order: "
        f"same flags and the same --dualpipe-stage-costs or --dualpipe-schedule-file file on every rank"
    )


__all__ = ["PlanMismatchError", "check_plan_agreement", "plan_digest"]
