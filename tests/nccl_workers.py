"""Rank processes for tests/test_nccl_sweep.py (launched with runtime_workers.launch)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from runtime_workers import HIDDEN, MICRO_ROWS, SEED, Block, SumSquares, batch


def unsafe_order_step(rank: int, world: int) -> dict[str, Any]:
    """A 1F1B step whose ranks post every receive before any send: gloo completes it, NCCL would not."""
    from dualpipe_megatron.runtime import Pipeline, pipeline
    from dualpipe_megatron.runtime.comm_log import RECV

    built = pipeline.MessagePlan.build

    class ReceivesFirst(pipeline.MessagePlan):
        @classmethod
        def build(cls, sched, rank, forward_only):
            plan = built(sched, rank, forward_only)
            return replace(plan, sequence=sorted(plan.sequence, key=lambda item: item[0] != RECV))

    pipeline.MessagePlan = ReceivesFirst
    m = 2 * world
    torch.manual_seed(SEED)
    (x,), y = batch(m * MICRO_ROWS, torch.float32)
    pipe = Pipeline([Block(HIDDEN)], "1f1b", p2p_shapes=[(MICRO_ROWS, HIDDEN)], p2p_dtype=torch.float32,
                    timeout=30.0)
    try:
        pipe.step(*([x] if rank == 0 else []), num_microbatches=m, criterion=SumSquares(x.shape[0]),
                  labels=[y] if rank == world - 1 else [])
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None, "message": ""}
