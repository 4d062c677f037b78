"""DualPipe keeps two copies of every stage; their gradients must be summed after a step."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .p2p import wait
from .pipeline import resolve_ranks


def sync_mirrored_grads(
    modules: Sequence[nn.Module],
    group: dist.ProcessGroup | None = None,
    rank_mapping: Sequence[int] | None = None,
    timeout: float = 600.0,
) -> None:
    """Sum the gradients of DualPipe's two copies of each stage, on both holders.

    Rank ``r`` holds stage ``r`` of direction 0 (``modules[0]``) and stage
    ``P-1-r`` of direction 1 (``modules[1]``); the copy of its ``modules[0]``
    is ``modules[1]`` on rank ``P-1-r`` and the other way round. Both ranks add
    the same two tensors, so the copies stay bitwise identical. A missing grad
    counts as zero.
    """
    group = group or dist.group.WORLD
    rank, group_rank_of = resolve_ranks(group, rank_mapping)
    size = group.size()
    if len(modules) != 2 or size % 2:
        raise ValueError(f"DualPipe needs 2 modules per rank and an even rank count, got {len(modules)} and {size}")
    peer = group_rank_of[size - 1 - rank]
    own = [list(m.parameters()) for m in modules]
    for params in own:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    # Both sides send modules[0]'s grads then modules[1]'s, and receive in that order. NCCL runs
    # the pair's sends and receives in posting order on one stream and a send may wait for its
    # receive, so the lower rank sends first and the higher rank receives first.
    theirs = [[torch.empty_like(p) for p in own[1]], [torch.empty_like(p) for p in own[0]]]
    sends = [lambda p=p: dist.isend(p.grad, group=group, group_dst=peer) for params in own for p in params]
    recvs = [lambda t=t: dist.irecv(t, group=group, group_src=peer) for bufs in theirs for t in bufs]
    works = [post() for post in (sends + recvs if rank < size - 1 - rank else recvs + sends)]
    for work in works:
        wait(work, timeout, lambda: f"pipeline rank {rank}: mirrored grad exchange with rank {size - 1 - rank}")
    for params, mirrored in zip(own, reversed(theirs)):
        for p, g in zip(params, mirrored):
            p.grad += g
