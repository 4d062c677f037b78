"""Megatron model chunks as the executor's handlers, and their data by micro-batch key.

:class:`MegatronHandlers` runs each F through Megatron's own ``forward_step`` on
the chunk of the op's stage for the micro-batch the op's key names, so a
schedule may run a stage's forwards in any micro-batch order and each still
reads its own data; a loss stage's B is Megatron's ``backward_step``. Megatron's
data iterators are sequential, so :class:`MicrobatchData` reads them ahead as
far as a requested micro-batch and keeps what was read early until it is asked
for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from megatron.core.pipeline_parallel import schedules as mcore_schedules

from ..runtime.handlers import Forwarded, StageHandlers
from ..runtime.wgrad import run_backward
from ..schedules import B, Key
from .predicates import running_chunk


class MicrobatchData:
    """One chunk's data iterator, read by micro-batch index (0..total-1 within the step).

    Reading is lazy: a chunk whose forward step never reads its iterator (a middle
    stage) never consumes it.
    """

    def __init__(self, it: Iterator | None, total: int) -> None:
        self.it, self.total = it, total
        self.read = 0
        self.early: dict[int, Any] = {}

    def get(self, index: int) -> Any:
        if not 0 <= index < self.total:
            raise IndexError(f"micro-batch {index} outside this step's {self.total}")
        if index in self.early:
            return self.early.pop(index)
        if index < self.read:
            raise RuntimeError(f"micro-batch {index}'s data was already read once this step")
        while self.read < index:
            self.early[self.read] = next(self.it)
            self.read += 1
        self.read += 1
        return next(self.it)

    def reader(self, index: int) -> Iterator | None:
        """An iterator whose ``next`` is micro-batch ``index`` (what Megatron's forward step reads)."""
        return None if self.it is None else _OneItem(self, index)

    def finish(self) -> None:
        """Leave the iterator at the start of the next step, as Megatron's schedules do."""
        if self.read:
            for _ in range(self.total - self.read):
                next(self.it)
        self.read, self.early = self.total, {}


class _OneItem:
    def __init__(self, data: MicrobatchData, index: int) -> None:
        self.data, self.index = data, index

    def __iter__(self) -> "_OneItem":
        return self

    def __next__(self) -> Any:
        return self.data.get(self.index)


@dataclass
class MegatronStep:
    """What every stage of one step shares."""

    forward_step_func: Callable
    model: Sequence[nn.Module]
    data: list[MicrobatchData]  # per chunk
    config: Any
    num_microbatches: int
    cp_size: int
    forward_only: bool
    first_val_step: bool | None
    stores: dict[int, dict[int, list]] = field(default_factory=dict)  # direction -> micro-batch -> reports
    microbatch: int | None = None  # global micro-batch of the forward running now (or last run)
    mtp_records: list | None = None  # MTP metrics of a training step, by micro-batch (mtp.py)
    # Tokens of this rank's loss stages; on the model's device (it is all-reduced with the backend).
    num_tokens: torch.Tensor = field(default_factory=lambda: torch.tensor(0, dtype=torch.int))

    def store_for(self, d: int, m: int) -> list:
        """The ``forward_data_store`` list micro-batch ``m`` of direction ``d`` reports into."""
        return self.stores.setdefault(d, {}).setdefault(m, [])

    def reports(self, d: int) -> list:
        """Direction ``d``'s loss reports in micro-batch order, whatever order the forwards ran in."""
        by_m = self.stores.get(d, {})
        return [report for m in sorted(by_m) for report in by_m[m]]

    def finish(self) -> None:
        for data in self.data:
            data.finish()


class MegatronHandlers(StageHandlers):
    """This rank's stages ``stages[c]`` (held in chunk ``c``) as Megatron computes them.

    An F runs Megatron's ``forward_step`` for micro-batch ``key.m`` of its direction (global
    micro-batch ``key.d * per_direction + key.m``) on the received activation (none on a first
    stage) and gives the stage output, or on the last stage the loss. ``is_first_microbatch``
    (TE's FP8 weight caching) is the first forward the chunk runs in the step, whatever its
    micro-batch. A loss stage's B is Megatron's ``backward_step`` (grad scaling, the
    backward-compute timer); other B's backpropagate the received grad through the engine,
    because a sent output has lost its storage (``backward_step`` needs Megatron's one-element
    stand-in for that).
    """

    def __init__(self, step: MegatronStep, stages: Sequence[tuple[int, int]], last_stage: int,
                 per_direction: int) -> None:
        self.step, self.last_stage, self.per_direction = step, last_stage, per_direction
        self.chunk_of = {ds: c for c, ds in enumerate(stages)}
        self.forwards = [0] * len(stages)  # per chunk, this step

    def forward_args(self, key: Key) -> tuple[int, Iterator | None, int, bool]:
        """(chunk, data reader, global micro-batch, first forward of the chunk) for the F of ``key``."""
        step, chunk = self.step, self.chunk_of[(key.d, key.s)]
        first = mcore_schedules.check_first_val_step(step.first_val_step, step.forward_only,
                                                     self.forwards[chunk] == 0)
        self.forwards[chunk] += 1
        global_m = key.d * self.per_direction + key.m
        step.microbatch = global_m
        return chunk, step.data[chunk].reader(global_m), global_m, first

    def forward(self, key: Key, inputs: list[Any]) -> Forwarded:
        step = self.step
        chunk, reader, global_m, first = self.forward_args(key)
        is_last = key.s == self.last_stage
        with running_chunk(chunk):
            output, num_tokens = mcore_schedules.forward_step(
                step.forward_step_func, reader, step.model[chunk],
                step.num_microbatches, inputs[0] if inputs else None,
                step.store_for(key.d, key.m), step.config, step.cp_size,
                is_first_microbatch=first, current_microbatch=global_m,
                vp_stage=chunk, is_last_stage=is_last,
            )
        if not is_last:
            return [output], None
        step.num_tokens += num_tokens
        return [], output

    def backward(self, half: B, inputs: list[Any], loss: torch.Tensor | None, outputs: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        if loss is not None:
            mcore_schedules.backward_step(inputs, loss, None, self.step.config)
        elif outputs:
            run_backward(outputs, grads)


__all__ = ["MegatronHandlers", "MegatronStep", "MicrobatchData"]
