"""Rank processes for tests/test_trace_runtime.py: the runtime ``Pipeline`` with an ``OpTracer``."""

from __future__ import annotations

from typing import Any

import torch

from runtime_workers import MICRO_ROWS, SumSquares, batch, build_layers, layers_of


def traced_steps(rank: int, world: int, trace_dir: str, microbatches: int) -> dict[str, Any]:
    """Two training steps, one forward-only step, one more training step of DualPipeV, traced."""
    from dualpipe_megatron.runtime import Pipeline
    from dualpipe_megatron.schedules import build_schedule
    from dualpipe_megatron.trace import OpTracer

    sched = build_schedule("dualpipev", world, microbatches)
    layers = build_layers(sched.stages, torch.float32)
    rows = MICRO_ROWS * microbatches
    inputs, y = batch(rows, torch.float32)
    first = rank == sched.rank_of(0, 0)
    pipe = Pipeline([layers[s] for s in layers_of(sched, rank)], sched,
                    p2p_shapes=[(MICRO_ROWS, inputs[0].shape[1])], p2p_dtype=torch.float32,
                    observer=OpTracer.for_group(trace_dir))
    kwargs = dict(num_microbatches=microbatches, criterion=SumSquares(rows), labels=[y] if first else [])
    losses = []
    for forward_only in (False, False, True, False):
        with torch.set_grad_enabled(not forward_only):
            loss, _ = pipe.step(*(inputs if first else [None]), **kwargs)
        losses.append(None if loss is None else float(loss.sum()))
    return {"losses": losses}
