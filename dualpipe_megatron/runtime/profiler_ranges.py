"""Named profiler ranges for the ops the executor runs, made only while a profiler records.

Every executed op (F, B, W, or an F&B pair) runs inside a
``torch.profiler.record_function`` range named after it, so a
``torch.profiler.profile`` trace (Megatron's ``--profile --use-pytorch-profiler``)
shows each rank's ops in schedule order; under ``torch.autograd.profiler.emit_nvtx``
(Megatron's ``--profile`` for nsys) the same ranges are NVTX ranges. With no
profiler on, :func:`op_range` returns one shared no-op context: no name is
formatted and nothing is allocated per op (``bench/profiler_ranges_overhead.py``
measures what is left). Names (``docs/profiling.md``)::

    dualpipe F d0 s1 m3
    dualpipe B d1 s0 m2            (w=false: "dualpipe B d1 s0 m2 w=false")
    dualpipe W d0 s1 m2
    dualpipe FB F(d0 s1 m3) B(d1 s2 m0)
"""

from __future__ import annotations

import re
from contextlib import AbstractContextManager, nullcontext

from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function

from ..schedules.ir import B
from .plan import Half

PREFIX = "dualpipe "
# The grammar of every range name, for tools reading a trace back.
NAME = re.compile(
    r"dualpipe (?:(?P<kind>[FBW]) (?P<key>d\d+ s\d+ m\d+(?: w=false)?)"
    r"|FB F\((?P<f>d\d+ s\d+ m\d+)\) B\((?P<b>d\d+ s\d+ m\d+(?: w=false)?)\))"
)

_OFF = nullcontext()  # stateless, so one instance serves every op and every thread


def _key(half: Half) -> str:
    k = half.key
    tail = " w=false" if isinstance(half, B) and not half.w else ""
    return f"d{k.d} s{k.s} m{k.m}{tail}"


def range_name(parts: tuple[Half, ...]) -> str:
    """The range name of an executed op: one half, or an F&B pair as (F, B)."""
    if len(parts) == 2:
        f, b = parts
        return f"{PREFIX}FB F({_key(f)}) B({_key(b)})"
    (half,) = parts
    return f"{PREFIX}{type(half).__name__} {_key(half)}"


def op_range(parts: tuple[Half, ...]) -> AbstractContextManager:
    """A range around one executed op while any autograd profiler (Kineto, NVTX, ITT) is on."""
    if not _profiler_enabled():
        return _OFF
    return record_function(range_name(parts))


__all__ = ["NAME", "PREFIX", "op_range", "range_name"]
