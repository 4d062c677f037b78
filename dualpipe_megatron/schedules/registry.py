"""Name -> generator lookup, with the input checks every caller shares."""

from __future__ import annotations

from typing import Callable

from .baselines import interleaved, one_f_one_b, zb1p
from .chimera import chimera
from .dualpipe import dualpipe, dualpipev
from .ir import Schedule, ScheduleError
from .vhalf import vhalf
from .zbv import zbv

GENERATORS: dict[str, Callable[..., Schedule]] = {
    "dualpipev": dualpipev,
    "dualpipe": dualpipe,
    "1f1b": one_f_one_b,
    "zb1p": zb1p,
    "interleaved": interleaved,
    "zbv": zbv,
    "vhalf": vhalf,
    "chimera": chimera,
}


def build_schedule(
    name: str,
    ranks: int,
    microbatches: int,
    chunks: int | None = None,
    group_size: int | None = None,
) -> Schedule:
    """Build the named schedule; ``chunks``/``group_size`` apply to ``interleaved`` only."""
    generator = GENERATORS.get(name)
    if generator is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose from {', '.join(GENERATORS)}")
    if name == "interleaved":
        return generator(ranks, microbatches, chunks=chunks or 2, group_size=group_size)
    if chunks not in (None, 2 if name == "dualpipev" else 1) or group_size is not None:
        raise ScheduleError(f"--chunks/--group-size apply only to interleaved, not {name}")
    return generator(ranks, microbatches)
