"""FLOPs per op and saved activation bytes of a chunk, counted on the meta device.

Counting runs the real layer code on shape-only tensors, so the full
DeepSeek-V3 chunk is counted in about a second without memory, and the
measured and the projected shape are counted by the same rules:
- FLOPs are what ``torch.utils.flop_counter`` counts (matrix products and
  attention; elementwise ops count zero; causal attention counts as full).
- saved bytes are the tensors autograd keeps from a forward for its backward,
  each tensor object once, parameters excluded. The attention core is counted
  as a flash kernel keeps it (q, k, v, output and an fp32 log-sum-exp per row),
  not as the meta device's unfused fallback, which would keep the score matrix.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..runtime.wgrad import WeightGradStore, deferring
from .layer import AttentionCore, build_chunk, chunk_input
from .shapes import LayerShape

_KEY = "count"


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


def _flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def count_chunk(s: LayerShape, dtype: torch.dtype = torch.bfloat16) -> ChunkCount:
    """Count one micro-batch's F, B, B(w=false), W and saved bytes of ``s`` on the meta device.

    The chunk's layers are identical, so one is counted and the figures multiplied.
    """
    one = _count_built(replace(s, layers=1), dtype)
    return ChunkCount(*(s.layers * getattr(one, f.name) for f in fields(ChunkCount)))


def _count_built(s: LayerShape, dtype: torch.dtype) -> ChunkCount:
    chunk = build_chunk(s, "meta", dtype)
    saved = _SavedBytes(chunk)
    x = chunk_input(s, "meta", dtype)
    with saved.recording():
        out: list[torch.Tensor] = []
        f = _flops(lambda: out.append(chunk(x)))
    grad = torch.empty_like(out[0])
    b = _flops(lambda: out[0].backward(grad))
    y = chunk(chunk_input(s, "meta", dtype))
    with deferring(_KEY):
        b_input = _flops(lambda: y.backward(grad))
    w = _flops(lambda: WeightGradStore.pop(_KEY))
    params = sum(p.numel() for p in chunk.parameters())
    return ChunkCount(F=f, B=b, B_input=b_input, W=w, saved_bytes=saved.total, params=params)


__all__ = ["ChunkCount", "count_chunk"]
