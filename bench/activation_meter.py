"""Peak activation bytes of one step, the same meter for every schedule.

CPU tensors have no allocator statistics, so the meter counts what a pipeline
schedule actually decides about: storages kept alive for backward. A storage
counts from the moment autograd saves a tensor on it (or a deferred weight-grad
closure captures one) until the last such holder is gone; storages shared by
several saved tensors count once, parameters never. A storage freed in place while held
(``resize_(0)``: Megatron's output-discarding checkpoint of selective recompute) stops counting
then. Receive buffers, gradients and temporaries are not activations and are not counted. With ``timeline`` the meter also
keeps the live bytes after every change, on the clock the op tracer reads, so a traced step's
ops can be given their bytes (op_bytes.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from time import perf_counter_ns
from typing import Any

import torch

from dualpipe_megatron.runtime.wgrad import WeightGradStore


class _Saved:
    """What the graph holds instead of a saved tensor: its lifetime is the saved tensor's."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _captured_tensors(func: Callable[[], None]) -> list[torch.Tensor]:
    """Tensors a weight-grad closure or ``functools.partial`` keeps alive."""
    if isinstance(func, partial):
        values: Iterable[Any] = (*func.args, *func.keywords.values())
    else:
        values = (cell.cell_contents for cell in (getattr(func, "__closure__", None) or ()))
    return [v for v in values if isinstance(v, torch.Tensor)]


class ActivationMeter:
    """Live and peak bytes of storages held for backward, outside ``params``."""

    def __init__(self, params: Iterable[torch.Tensor], timeline: bool = False) -> None:
        # Storages are keyed by their StorageImpl (``_cdata``), which an in-place resize keeps.
        self._excluded = {p.untyped_storage()._cdata for p in params}
        self._holders: dict[int, int] = {}  # storage -> holders alive
        self._bytes: dict[int, int] = {}  # storage -> its bytes as counted now
        self.live = 0
        self.peak = 0
        # (perf_counter_ns, live bytes) after every change, when asked for
        self.timeline: list[tuple[int, int]] | None = [] if timeline else None

    def _hold(self, tensor: torch.Tensor, holder: object) -> None:
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key in self._excluded or size == 0:
            return
        if self._holders.get(key, 0) == 0:
            self._bytes[key] = size
            self.live += size
            self.peak = max(self.peak, self.live)
            self._record()
        self._holders[key] = self._holders.get(key, 0) + 1
        weakref.finalize(holder, self._release, key)

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live -= self._bytes.pop(key)
            self._record()

    def _resize(self, original: Callable[..., Any], storage: torch.UntypedStorage, size: int) -> Any:
        """A held storage shrunk in place (freed) or regrown counts its new size."""
        out = original(storage, size)
        key = storage._cdata
        if key in self._bytes:
            self.live += storage.nbytes() - self._bytes[key]
            self._bytes[key] = storage.nbytes()
            self.peak = max(self.peak, self.live)
            self._record()
        return out

    def _record(self) -> None:
        if self.timeline is not None:
            self.timeline.append((perf_counter_ns(), self.live))

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        holder = _Saved(tensor)
        self._hold(tensor, holder)
        return holder

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def _put(self, original: Callable[[Callable[[], None]], None], func: Callable[[], None]) -> None:
        for tensor in _captured_tensors(func):
            self._hold(tensor, func)
        original(func)

    @contextmanager
    def measuring(self) -> Iterator[None]:
        """Count while inside; ``peak`` is then the most bytes held at once beyond the bytes
        already held on entry."""
        saved = vars(WeightGradStore)["put"]
        resize = torch.UntypedStorage.resize_
        WeightGradStore.put = partial(self._put, WeightGradStore.put)  # type: ignore[method-assign]
        torch.UntypedStorage.resize_ = lambda storage, size: self._resize(resize, storage, size)  # type: ignore[method-assign]
        start = self.live
        self.peak = start
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            WeightGradStore.put = saved  # type: ignore[method-assign]
            torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
        self.peak -= start
