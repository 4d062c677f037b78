"""The reference's process-wide p2p declarations (``dualpipe.comm``)."""

from __future__ import annotations

import torch

TENSOR_SHAPES: list[tuple[int, ...]] | None = None
TENSOR_DTYPE: torch.dtype | None = None


def set_p2p_tensor_shapes(shapes: list[tuple[int, ...]]) -> None:
    """Shapes of the tensors every stage sends, per micro-batch."""
    global TENSOR_SHAPES
    TENSOR_SHAPES = [tuple(s) for s in shapes]


def set_p2p_tensor_dtype(dtype: torch.dtype) -> None:
    global TENSOR_DTYPE
    TENSOR_DTYPE = dtype
