"""Rank processes for tests/test_runtime_autocast.py: DualPipeV (compat API) under bf16 autocast.

Each rank also runs the single-process reference (whole model, one micro-batch at a time,
forward under autocast and ``loss.backward()`` outside it, as ordinary training code does), so
both run with the same thread settings, and reports both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import runtime_workers as rw

AUTOCAST = torch.bfloat16


def dualpipev_autocast(rank: int, world: int) -> dict[str, Any]:
    """One DualPipeV training step under bf16 autocast, and the reference's loss and grads."""
    from dualpipe_megatron.compat import DualPipeV, set_p2p_tensor_dtype, set_p2p_tensor_shapes
    from dualpipe_megatron.schedules import build_schedule

    m = 2 * world + 2
    sched = build_schedule("dualpipev", world, m)
    stages = rw.layers_of(sched, rank)
    (x,), y = rw.batch(m * rw.MICRO_ROWS, torch.float32)
    criterion = rw.SumSquares(y.shape[0])

    set_p2p_tensor_shapes([(rw.MICRO_ROWS, rw.HIDDEN)])
    set_p2p_tensor_dtype(torch.float32)  # a Block's output is float32 (residual + LayerNorm)
    layers = rw.build_layers(sched.stages, torch.float32)
    pipe = DualPipeV(nn.Sequential(*(layers[s] for s in stages)))
    first = rank == 0  # DualPipeV: rank 0 holds the first and the last stage
    with torch.autocast("cpu", dtype=AUTOCAST):
        loss, _ = pipe.step(
            x if first else None, num_chunks=m, criterion=criterion, labels=(y if first else None,)
        )

    # Micro-batch by micro-batch, so grads add up in the order the pipeline adds them: every
    # DualPipeV stage runs its backwards, and its deferred weight grads, in micro-batch order.
    ref = rw.build_layers(sched.stages, torch.float32)
    ref_losses = []
    for mb in range(m):
        rows = slice(mb * rw.MICRO_ROWS, (mb + 1) * rw.MICRO_ROWS)
        with torch.autocast("cpu", dtype=AUTOCAST):
            out = x[rows]
            for layer in ref:
                out = layer(out)
            ref_loss = criterion(out, y[rows])
        ref_loss.backward()
        ref_losses.append(ref_loss.detach())
    return {
        "loss": loss, "ref_loss": torch.stack(ref_losses), "deferred": pipe.stats.deferred,
        "grads": [p.grad for p in pipe.parameters()],
        "ref_grads": [p.grad for s in stages for p in ref[s].parameters()],
    }
