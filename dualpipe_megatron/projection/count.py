"""FLOPs per op and saved activation bytes of a chunk (a stage shape of MoE layers).

- FLOPs are the one FLOP count of :mod:`..schedules.model_shape` (the layout search's too):
  matrix products and attention, causal attention as the half of the square under the mask,
  elementwise ops zero. ``B_input`` is ``B - W``. ``tests/test_auto_layout.py`` holds it equal
  to ``torch.utils.flop_counter`` on this layer, plus the causal half torch also counts.
- saved bytes are the tensors autograd keeps from a forward for its backward, each tensor
  object once, parameters excluded, counted by running the real layer code on the meta device
  (shape-only tensors: the full DeepSeek-V3 chunk in about a second, without memory). The
  attention core is counted as a flash kernel keeps it (q, k, v, output and an fp32
  log-sum-exp per row), not as the meta device's unfused fallback, which would keep the score
  matrix.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from ..schedules.model_shape import ModelShape
from .layer import AttentionCore, build_chunk, chunk_input


@dataclass(frozen=True)
class ChunkCount:
    """FLOPs of each op of one micro-batch through the chunk, and its saved activation bytes."""

    F: int
    B: int  # full backward
    B_input: int  # input-grad-only backward
    W: int
    saved_bytes: int
    params: int  # parameters of the chunk on one EP rank


class _SavedBytes:
    """Bytes autograd saves, with each attention core counted as a flash kernel's."""

    def __init__(self, chunk: torch.nn.Module) -> None:
        self.params = {id(p) for p in chunk.parameters()}
        self.seen: set[int] = set()
        self.kept: list[torch.Tensor] = []  # alive while counting, so no id is reused
        self.total = 0
        self.paused = False
        for m in chunk.modules():
            if isinstance(m, AttentionCore):
                m.register_forward_pre_hook(self._enter)
                m.register_forward_hook(self._leave)

    def _add(self, t: torch.Tensor) -> None:
        if id(t) not in self.seen and id(t) not in self.params:
            self.seen.add(id(t))
            self.kept.append(t)
            self.total += t.numel() * t.element_size()

    def _enter(self, module: torch.nn.Module, args: tuple) -> None:
        self.paused = True

    def _leave(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.paused = False
        for t in (*args, out):
            self._add(t)
        self.total += out.shape[0] * out.shape[1] * out.shape[2] * 4  # log-sum-exp, fp32

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not self.paused:
            self._add(t)
        return t

    @contextmanager
    def recording(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield


def count_chunk(s: ModelShape, dtype: torch.dtype = torch.bfloat16) -> ChunkCount:
    """One micro-batch's F, B, B(w=false) and W FLOPs of ``s``, and its saved bytes and
    parameters (the chunk's layers are identical: one is built on the meta device, its figures
    multiplied)."""
    layer = s.decoder(moe=True)
    F, B, W = (int(layer.F) * s.num_layers, int(layer.B) * s.num_layers, int(layer.W) * s.num_layers)
    saved, params = _built(replace(s, num_layers=1), dtype)
    return ChunkCount(F=F, B=B, B_input=B - W, W=W, saved_bytes=s.num_layers * saved,
                      params=s.num_layers * params)


def _built(s: ModelShape, dtype: torch.dtype) -> tuple[int, int]:
    """Saved activation bytes of one forward of ``s``'s chunk, and its parameters."""
    chunk = build_chunk(s, "meta", dtype)
    saved = _SavedBytes(chunk)
    with saved.recording():
        chunk(chunk_input(s, "meta", dtype))
    return saved.total, sum(p.numel() for p in chunk.parameters())


__all__ = ["ChunkCount", "count_chunk"]
