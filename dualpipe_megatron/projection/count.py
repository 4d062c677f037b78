"""FLOPs per op and saved activation bytes of a chunk (a stage shape of MoE layers).

- FLOPs are the one FLOP count of :mod:`..schedules.model_shape` (the layout search's too):
  matrix products and attention, causal attention as the half of the square under the mask,
  elementwise ops zero. ``B_input`` is ``B - W``. ``tests/test_auto_layout.py`` holds it equal
  to ``torch.utils.flop_counter`` on this layer, plus the causal half torch also counts.
- saved bytes are what Megatron's Transformer Engine layers keep for the backward in the
  activation dtype without recompute (:mod:`.activations`, the launch plan's terms).
- parameters are counted on the layer built on the meta device (shape-only tensors: the full
  DeepSeek-V3 chunk in about a second, without memory).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..schedules.model_shape import ModelShape
from . import activations
from .layer import build_chunk


@dataclass(frozen=True)
class ChunkCount:
    """FLOPs of each op of one micro-batch through the chunk, and its saved activation bytes."""

    F: int
    B: int  # full backward
    B_input: int  # input-grad-only backward
    W: int
    saved_bytes: int
    params: int  # parameters of the chunk on one EP rank


def count_chunk(s: ModelShape, dtype: torch.dtype = torch.bfloat16) -> ChunkCount:
    """One micro-batch's F, B, B(w=false) and W FLOPs of ``s``, and its saved bytes and
    parameters (the chunk's layers are identical: one is built on the meta device, its
    parameters multiplied)."""
    layer = s.decoder(moe=True)
    F, B, W = (int(layer.F) * s.num_layers, int(layer.B) * s.num_layers, int(layer.W) * s.num_layers)
    saved = activations.layer_bytes(s, activations.Options(act_bytes=dtype.itemsize), moe=True)
    return ChunkCount(F=F, B=B, B_input=B - W, W=W, saved_bytes=round(s.num_layers * saved),
                      params=s.num_layers * _params(replace(s, num_layers=1), dtype))


def _params(s: ModelShape, dtype: torch.dtype) -> int:
    """Parameters of ``s``'s chunk built on the meta device."""
    return sum(p.numel() for p in build_chunk(s, "meta", dtype).parameters())


__all__ = ["ChunkCount", "count_chunk"]
