"""Records the ops one rank executes and appends them, one line per step, to ``DIR/rank{g}.jsonl``.

The hot path is one tuple appended per op (the executor reads the clock only
when a recorder is attached); encoding and writing happen once per step, after
its last op. Times are ``time.perf_counter_ns()`` host readings. On CPU that
is when the work ran. On CUDA it is when the host issued the work and when its
waits returned; kernels run asynchronously, so use a GPU profiler when
kernel-exact times matter. Each file carries the offset from that clock to the
wall clock, so ranks on several hosts line up as well as their clocks agree.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from time import perf_counter_ns
from typing import Callable, Sequence

import torch.distributed as dist

from ..runtime.pipeline import resolve_ranks
from ..schedules.ir import B, F, FB, Op, Schedule, W, op_to_json

FORMAT = "dualpipe-megatron-trace/1"
Half = F | B | W


def trace_path(directory: str | os.PathLike[str], global_rank: int) -> Path:
    return Path(directory) / f"rank{global_rank}.jsonl"


def executed_op(parts: tuple[Half, ...]) -> Op:
    """The op a rank ran: a single half, or both halves of an F&B pair."""
    if len(parts) == 1:
        return parts[0]
    f, b = parts
    assert isinstance(f, F) and isinstance(b, B)
    return FB(f, b)


class OpTracer:
    """An :class:`~dualpipe_megatron.runtime.executor.OpObserver` writing one rank's trace file.

    ``pipeline[r]`` is the global rank of pipeline rank ``r``; it identifies the
    pipeline this rank belongs to when several (data-parallel, tensor-parallel,
    ...) replicas trace into one directory. ``clock`` must be the clock the
    executor reads (tests pass a fake one together with fake op times).
    """

    def __init__(self, directory: str | os.PathLike[str], pipeline_rank: int, pipeline: Sequence[int],
                 clock: Callable[[], int] = perf_counter_ns) -> None:
        self._clock = clock
        global_rank = dist.get_rank() if dist.is_initialized() else pipeline[pipeline_rank]
        header = {
            "format": FORMAT,
            "global_rank": global_rank,
            "world_size": dist.get_world_size() if dist.is_initialized() else len(pipeline),
            "pipeline_rank": pipeline_rank,
            "pipeline": list(pipeline),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "epoch_offset_ns": time.time_ns() - clock(),
        }
        path = trace_path(directory, global_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w", buffering=1)  # line-buffered: a step is on disk once written
        self._file.write(json.dumps(header) + "\n")
        self._steps = 0
        self._ops: list[tuple[int, tuple[Half, ...], int, int, int]] = []

    @classmethod
    def for_group(cls, directory: str | os.PathLike[str], group: dist.ProcessGroup | None = None,
                  rank_mapping: Sequence[int] | None = None) -> "OpTracer":
        """The tracer of this process in pipeline ``group`` (``rank_mapping`` as for ``Pipeline``)."""
        group = group or dist.group.WORLD
        pipeline_rank, group_rank_of = resolve_ranks(group, rank_mapping)
        return cls(directory, pipeline_rank, [dist.get_global_rank(group, g) for g in group_rank_of])

    # -- OpObserver ------------------------------------------------------------------
    def step_begun(self, sched: Schedule, forward_only: bool) -> None:
        self._sched, self._forward_only = sched, forward_only
        self._ops = []
        self._begin = self._clock()

    def op_done(self, index: int, parts: tuple[Half, ...], begin_ns: int, end_ns: int, wait_ns: int) -> None:
        self._ops.append((index, parts, begin_ns, end_ns, wait_ns))

    def step_done(self) -> None:
        end, sched = self._clock(), self._sched
        record = {
            "step": self._steps, "forward_only": self._forward_only,
            "schedule": sched.name, "ranks": sched.ranks, "stages": sched.stages,
            "microbatches": sched.microbatches, "directions": sched.directions,
            "begin_ns": self._begin, "end_ns": end,
            "ops": [{"index": index, **op_to_json(executed_op(parts)), "begin_ns": begin,
                     "end_ns": stop, "wait_ns": wait}
                    for index, parts, begin, stop, wait in self._ops],
        }
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._steps += 1
        self._ops = []

    def close(self) -> None:
        self._file.close()


__all__ = ["FORMAT", "OpTracer", "executed_op", "trace_path"]
