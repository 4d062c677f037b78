"""Per-rank compute time of a step, for the measured bubble: fenced step time minus this.

Busy time is time spent computing a forward, a loss or a backward; everything
else in a step (p2p waits, posting, scheduling) is bubble. Megatron's schedules
and torch's are timed by wrapping the functions they compute in (p2p happens
outside them); ours by the op traces the executor records (op span minus
receive wait), which also count posting sends and the executor's per-op work.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dualpipe_megatron.trace.recorder import trace_path
from dualpipe_megatron.trace.records import read_rank


class ComputeClock:
    """Seconds spent inside the wrapped callables since the last :meth:`take`."""

    def __init__(self) -> None:
        self._seconds = 0.0
        self._depth = 0  # a wrapped call inside another counts once

    def wrap(self, func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._seconds += time.perf_counter() - start
        return timed

    def take(self) -> float:
        seconds, self._seconds = self._seconds, 0.0
        return seconds


def time_megatron_compute(clock: ComputeClock) -> None:
    """Route Megatron's schedules' ``forward_step``/``backward_step`` through ``clock`` (this
    process only; the schedules look both up as module globals at call time)."""
    from megatron.core.pipeline_parallel import schedules

    schedules.forward_step = clock.wrap(schedules.forward_step)
    schedules.backward_step = clock.wrap(schedules.backward_step)


def time_torch_compute(clock: ComputeClock, schedule: Any, stages: list[Any]) -> None:
    """Route a torch pipelining schedule's stage forwards, backwards and losses through ``clock``."""
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, clock.wrap(getattr(stage, name)))
    schedule._maybe_compute_loss = clock.wrap(schedule._maybe_compute_loss)


def traced_busy_seconds(trace_dir: str | Path, global_rank: int) -> list[float]:
    """Per traced step of this rank, in order: the sum of its ops' span minus receive wait."""
    trace = read_rank(trace_path(trace_dir, global_rank))
    return [sum(op.busy for op in step.ops) / 1e9 for step in trace.steps]
