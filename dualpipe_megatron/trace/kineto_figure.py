"""Stream lanes of profiled GPU ranks over time, exposed communication marked, in the schedule figure's style.

One lane per CUDA stream of each rank, compute kernels coloured by the pass of
their phase (the schedule figure's F/B/W colours), communication in grey, and
under each rank a red strip where its communication runs with no compute.
Object-oriented Matplotlib only, as in :mod:`..schedules.draw`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..schedules.draw import BASE_COLOURS, FORMATS
from .kineto import PhaseTime, RankProfile, exposed_spans
from .records import TraceError

COLOURS = {"F": BASE_COLOURS["F"], "B": BASE_COLOURS["B"], "W": BASE_COLOURS["W"], "FB": "#9b6fc4",
           "other compute": "#b9b9b9", "communication": "#4d4d4d", "exposed communication": "#d62728"}
LANE = 0.8


def _colour(communication: bool, phase: PhaseTime | None) -> str:
    if communication:
        return COLOURS["communication"]
    return COLOURS.get(phase.kind or "", COLOURS["other compute"]) if phase else COLOURS["other compute"]


def draw_profiles(profiles: Sequence[RankProfile], path: str | os.PathLike[str]) -> None:
    """Write the stream lanes of every GPU rank in ``profiles`` to ``path`` (.png or .svg)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise TraceError(f"cannot draw to {os.fspath(path)!r}: use a .png or .svg suffix")
    ranks = [r for r in profiles if r.gpu]
    if not ranks:
        raise TraceError("no GPU events in the traces: nothing to draw (a CPU run has host-side times only)")
    lanes = sum(len(r.streams) + 1 for r in ranks)
    fig = Figure(figsize=(14.0, 1.4 + 0.38 * lanes), dpi=120, layout="constrained")
    ax = fig.subplots()
    y, ticks, labels, used = 0.0, [], [], set()
    for r in ranks:
        for s in r.streams:
            bars: dict[str, list[tuple[float, float]]] = {}
            for ev in r.events:
                if ev.stream == s.id:
                    colour = _colour(ev.communication, r.phases.get(ev.phase))
                    bars.setdefault(colour, []).append(((ev.start - r.origin) / 1e3, (ev.end - ev.start) / 1e3))
            for colour, spans in bars.items():
                ax.broken_barh(spans, (y - LANE / 2, LANE), facecolors=colour, linewidth=0)
                used.add(colour)
            ticks.append(y)
            labels.append(f"rank {r.rank} stream {s.id} ({s.kind})")
            y += 1
        spans = [((a - r.origin) / 1e3, (b - a) / 1e3) for a, b in exposed_spans(r)]
        ax.broken_barh(spans, (y - 0.7, 0.4), facecolors=COLOURS["exposed communication"], linewidth=0)
        used.add(COLOURS["exposed communication"])
        ticks.append(y - 0.5)
        labels.append(f"exposed {r.exposed_communication_ms:.2f} ms")
        y += 0.6
    ax.set_yticks(ticks, labels)
    ax.set_ylim(y - 0.4, -0.6)
    ax.set_xlim(0, max(r.window_ms for r in ranks))
    ax.set_xlabel("ms from each rank's first GPU event")
    ax.set_title("GPU streams: compute by pass of its range, communication, and communication no compute hides")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    handles = [Patch(facecolor=c, edgecolor="none", label=k) for k, c in COLOURS.items() if c in used]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.savefig(path, format=suffix[1:])


__all__ = ["draw_profiles"]
