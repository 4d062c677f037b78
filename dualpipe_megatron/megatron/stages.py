"""Megatron model chunks as the executor's stages, and their data by micro-batch key.

The executor calls a stage like a module with the received activation; a
:class:`MegatronStage` runs Megatron's own ``forward_step`` on its chunk for the
micro-batch the op names (the executor passes the op's key: ``takes_key``), so
a schedule may run a stage's forwards in any micro-batch order and each still
reads its own data. Megatron's data iterators are sequential, so
:class:`MicrobatchData` reads them ahead as far as a requested micro-batch and
keeps what was read early until it is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from megatron.core.pipeline_parallel import schedules as mcore_schedules

from ..schedules import Key
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


class MegatronStage:
    """Stage ``(d, s)`` held in chunk ``chunk``, called by the executor with the op's key.

    Its input is the received activation (none on the first stage); it runs
    Megatron's ``forward_step`` for micro-batch ``key.m`` of its direction (global
    micro-batch ``offset + key.m``) and returns the stage output, or on the last
    stage the (grad-scaled) loss the executor starts the backward from.
    ``is_first_microbatch`` (TE's FP8 weight caching) is the first forward this
    chunk runs in the step, whatever its micro-batch.
    """

    takes_key = True

    def __init__(self, step: MegatronStep, chunk: int, d: int, is_last: bool, offset: int) -> None:
        self.step, self.chunk, self.d, self.is_last, self.offset = step, chunk, d, is_last, offset
        self.forwards = 0

    def describe(self) -> str:
        return f"chunk {self.chunk} (direction {self.d}{', last stage' if self.is_last else ''})"

    def forward_args(self, key: Key) -> tuple[Iterator | None, int, bool]:
        """(data reader, global micro-batch, first forward of this chunk) for the F of ``key``."""
        step = self.step
        first = mcore_schedules.check_first_val_step(step.first_val_step, step.forward_only, self.forwards == 0)
        self.forwards += 1
        global_m = self.offset + key.m
        step.microbatch = global_m
        return step.data[self.chunk].reader(global_m), global_m, first

    def __call__(self, *inputs: torch.Tensor, key: Key) -> torch.Tensor:
        step = self.step
        reader, global_m, first = self.forward_args(key)
        with running_chunk(self.chunk):
            output, num_tokens = mcore_schedules.forward_step(
                step.forward_step_func, reader, step.model[self.chunk],
                step.num_microbatches, inputs[0] if inputs else None,
                step.store_for(self.d, key.m), step.config, step.cp_size,
                is_first_microbatch=first, current_microbatch=global_m,
                vp_stage=self.chunk, is_last_stage=self.is_last,
            )
        if not self.is_last:
            return output
        step.num_tokens += num_tokens
        if not step.forward_only and step.config.grad_scale_func is not None:
            output = step.config.grad_scale_func(output)
        return output


__all__ = ["MegatronStage", "MegatronStep", "MicrobatchData"]
