"""One schedule under test in a rank process: its timed steps, busy times and memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch import nn

from activation_meter import ActivationMeter
from busy_time import ComputeClock, traced_busy_seconds


def param_bytes(params: Sequence[nn.Parameter]) -> int:
    """Bytes of this rank's parameters, each storage once."""
    seen: dict[int, int] = {}
    for p in params:
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


@dataclass
class Variant:
    """A schedule on this rank: ``run`` is one forward-backward step of the configured batch.

    Busy time comes from ``clock`` (reset before and read after each step) or, when
    ``trace_dir`` is set, from this rank's op trace once all steps are done. ``last_output`` is
    what the latest step's ``run`` returned (the loss reports on the last pipeline rank).
    """

    name: str
    run: Callable[[], object]
    params: list[nn.Parameter]
    activate: Callable[[], None] = lambda: None
    clock: ComputeClock | None = None
    trace_dir: Path | None = None
    seconds: list[float] = field(default_factory=list)  # fenced time of each timed step
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time in each timed step
    _busy: list[float] = field(default_factory=list)  # busy seconds of every step, in order
    _timed: list[int] = field(default_factory=list)  # indices of the timed steps
    _steps: int = 0
    peak_activation_bytes: int = 0
    last_output: object = None

    def _step(self) -> None:
        self.activate()
        for p in self.params:
            p.grad = None
        if self.clock is not None:
            self.clock.take()
        self.last_output = self.run()
        if self.clock is not None:
            self._busy.append(self.clock.take())
        self._steps += 1

    def warm_up(self) -> None:
        self._step()

    def timed_step(self) -> None:
        """One step between barriers on every rank of the world."""
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        self._step()
        self.cpu_seconds.append(time.process_time() - cpu_start)
        dist.barrier()
        self.seconds.append(time.perf_counter() - start)
        self._timed.append(self._steps - 1)

    def memory_step(self, timeline: bool = False) -> ActivationMeter:
        """One untimed step under the activation meter (its hooks cost time); the meter, with its
        timeline of live bytes when asked for."""
        meter = ActivationMeter(self.params, timeline)
        dist.barrier()
        with meter.measuring():
            self._step()
        dist.barrier()
        self.peak_activation_bytes = meter.peak
        return meter

    def busy_seconds(self) -> list[float]:
        """Busy seconds of each timed step on this rank."""
        busy = self._busy if self.trace_dir is None else traced_busy_seconds(self.trace_dir, dist.get_rank())
        if len(busy) != self._steps:
            raise RuntimeError(f"{self.name}: {len(busy)} busy times recorded for {self._steps} steps")
        return [busy[i] for i in self._timed]

    def summary(self) -> dict[str, object]:
        """What rank 0 gathers from this rank."""
        return {"seconds": self.seconds, "cpu_seconds": self.cpu_seconds, "busy": self.busy_seconds(),
                "peak_activation_bytes": self.peak_activation_bytes, "param_bytes": param_bytes(self.params)}


def all_params(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for m in modules for p in m.parameters()]
