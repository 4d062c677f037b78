"""``DualPipe`` and ``DualPipeV`` with the reference's constructor and ``step``, run by our runtime."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.pipeline import Pipeline
from . import comm


class _ReferencePipe(Pipeline):
    """Reference signatures over :class:`Pipeline`; p2p shapes come from :mod:`.comm`."""

    schedule_name: str

    def __init__(
        self,
        modules: Sequence[nn.Module],
        batch_dim: int = 0,
        process_group: dist.ProcessGroup | None = None,
        rank_mapping: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            modules, self.schedule_name, process_group=process_group,
            batch_dim=batch_dim, rank_mapping=rank_mapping,
        )

    def step(
        self,
        *inputs: torch.Tensor | None,
        num_chunks: int = 0,
        criterion: Callable[..., torch.Tensor] | None = None,
        labels: Sequence[torch.Tensor | None] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, Any]:
        """A training step, or forward-only under ``torch.no_grad()``; ``num_chunks`` micro-batches."""
        if comm.TENSOR_SHAPES is None or comm.TENSOR_DTYPE is None:
            raise ValueError("call set_p2p_tensor_shapes and set_p2p_tensor_dtype before a step")
        self.p2p_shapes = comm.TENSOR_SHAPES
        self.p2p_dtype = comm.TENSOR_DTYPE
        return super().step(
            *inputs, num_microbatches=num_chunks, criterion=criterion,
            labels=labels, return_outputs=return_outputs,
        )


class DualPipeV(_ReferencePipe):
    """DualPipeV: ``modules`` = (stage ``r``, stage ``2P-1-r``); loss and outputs return on rank 0."""

    schedule_name = "dualpipev"


class DualPipe(_ReferencePipe):
    """DualPipe: ``modules`` = (stage ``r`` of direction 0, stage ``P-1-r`` of direction 1).

    Rank 0 takes the inputs of direction 0 and the labels of direction 1 (whose
    last stage it holds) and returns direction 1's loss and outputs; rank
    ``P-1`` the other way round. Call :func:`sync_mirrored_grads` after a
    training step to sum the two copies' gradients.
    """

    schedule_name = "dualpipe"
