"""Rank processes for tests/test_schedule_file.py: each rank given its own schedule file."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def first_step_plan(rank: int, world: int, paths: list[str], microbatches: int) -> dict[str, Any]:
    """Plan the first training step as the job does, rank r reading ``paths[r]``: the plan-agreement
    check runs before the step's first pipeline message, so a mismatch must stop it here."""
    from dualpipe_megatron.megatron.schedule import DualPipeOptions, plan_for_step
    from dualpipe_megatron.runtime import PlanMismatchError

    options = DualPipeOptions(schedule="dualpipev", schedule_file=paths[rank])
    try:
        sched, _ = plan_for_step(options, dist.group.WORLD, microbatches, False, torch.device("cpu"))
    except PlanMismatchError as exc:
        return {"error": str(exc), "ops": None}
    return {"error": None, "ops": [str(op) for op in sched.ops[rank]]}


def plans_from_files(rank: int, world: int, cases: dict[str, list[str]], microbatches: int) -> dict[str, Any]:
    """:func:`first_step_plan` for each case (a job of its own: a fresh ``DualPipeOptions``), in one launch."""
    return {name: first_step_plan(rank, world, paths, microbatches) for name, paths in cases.items()}
