"""Timeline pictures of a schedule, in the style of DeepSeek's DualPipe figure.

One row per rank, one coloured cell per op, labelled with its micro-batch.
Without times cells sit in unit slots, which shows op order alone; with a
:class:`SimResult` (or measured times) they sit at those times, which shows the
bubbles. Several timelines can share one figure and time axis (plan above,
measurement below).
Only the object-oriented Matplotlib API is used, so drawing never needs a
display and never touches pyplot's global state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .ir import B, F, FB, Op, Schedule, ScheduleError, W, halves

FORMATS = (".png", ".svg")
BASE_COLOURS = {"F": "#f59e42", "B": "#2bb3b1", "B (input grad)": "#8cc63f", "W": "#4a7fd0"}
ROW_HEIGHT = 0.8  # of a rank's unit row, leaving a gap between ranks
MIN_FONT, MAX_FONT = 5.0, 9.0
RGB = tuple[float, float, float]


def _kind(half: F | B | W) -> str:
    if isinstance(half, F):
        return "F"
    if isinstance(half, W):
        return "W"
    return "B" if half.w else "B (input grad)"


def _shade(kind: str, level: int, levels: int) -> RGB:
    """Lighter for the first chunk/direction, darker for the last, so both stay readable."""
    t = level / (levels - 1) if levels > 1 else 0.5
    mix = 0.5 - 0.85 * t  # > 0 blends toward white, < 0 toward black
    base = to_rgb(BASE_COLOURS[kind])
    target = 1.0 if mix > 0 else 0.0
    return tuple(c + abs(mix) * (target - c) for c in base)  # type: ignore[return-value]


class Timed(Protocol):
    """Per-rank op start/end times indexed like the schedule's op lists (a :class:`SimResult`, or measured)."""

    start: Sequence[Sequence[Any]]
    end: Sequence[Sequence[Any]]


@dataclass(frozen=True)
class Panel:
    """One timeline of a figure: ``sched`` at unit slots, or at ``times`` (same time unit in every panel)."""

    sched: Schedule
    times: Timed | None = None
    title: str | None = None
    xlabel: str | None = None


def _cells(sched: Schedule, times: Timed | None) -> list[list[tuple[float, float, Op]]]:
    """(x0, width, op) per op per rank: unit slots (FB is two), or the given times."""
    if times is not None and [len(r) for r in times.start] != [len(r) for r in sched.ops]:
        raise ScheduleError("draw_schedule: result does not belong to this schedule")
    rows = []
    for rank, ops in enumerate(sched.ops):
        row, x = [], 0.0
        for i, op in enumerate(ops):
            if times is None:
                width = float(len(halves(op)))
            else:
                x = float(times.start[rank][i])
                width = float(times.end[rank][i]) - x
            row.append((x, width, op))
            x += width
        rows.append(row)
    return rows


def _font_size(cells: list[list[tuple[float, float, Op]]], pt_per_x: float, row_pt: float) -> float:
    """One font for the whole figure, sized so a typical cell holds the longest label."""
    widths = sorted(w / len(halves(op)) for row in cells for _, w, op in row)
    if not widths:
        return MAX_FONT
    digits = max(len(str(h.key.m)) for row in cells for *_, op in row for h in halves(op))
    fit = (widths[len(widths) // 2] * pt_per_x - 2) / (0.62 * digits)
    return max(MIN_FONT, min(MAX_FONT, 0.6 * row_pt, fit))


def _shading(sched: Schedule) -> tuple[Callable[[F | B | W], int], int, str]:
    """Shade level of a half, number of levels and their name: by direction when there are
    two, else by the stage's chunk index on its rank."""
    if sched.directions == 2:
        return (lambda half: half.key.d), 2, "dir"
    chunk = {ds: sched.stages_on(r).index(ds) for ds, r in sched.placement.items()}
    return (lambda half: chunk[(half.key.d, half.key.s)]), max(chunk.values(), default=0) + 1, "chunk"


def _draw_cells(ax: Axes, cells: list[list[tuple[float, float, Op]]], level_of: Callable[[F | B | W], int],
                levels: int, pt_per_x: float, font: float) -> tuple[set[tuple[str, int]], bool]:
    """Paint one timeline; returns the (kind, level) pairs used and whether any F&B pair was drawn."""
    used: set[tuple[str, int]] = set()
    has_fb = False
    for rank, row in enumerate(cells):
        y = rank - ROW_HEIGHT / 2
        for x, width, op in row:
            parts = halves(op)
            part_w = width / len(parts)
            for j, half in enumerate(parts):
                kind, level = _kind(half), level_of(half)
                used.add((kind, level))
                colour = _shade(kind, level, levels)
                ax.add_patch(Rectangle((x + j * part_w, y), part_w, ROW_HEIGHT, facecolor=colour,
                                       edgecolor="white", linewidth=0.6))
                label = str(half.key.m)
                if part_w * pt_per_x - 2 >= 0.62 * font * len(label):  # else it would spill
                    dark = sum(w * c for w, c in zip((0.299, 0.587, 0.114), colour)) < 0.45
                    ax.text(x + (j + 0.5) * part_w, rank, label, ha="center", va="center",
                            fontsize=font, color="white" if dark else "black")
            if isinstance(op, FB):
                has_fb = True
                ax.add_patch(Rectangle((x, y), width, ROW_HEIGHT, fill=False, edgecolor="black",
                                       linewidth=1.4))
    return used, has_fb


def _default_title(sched: Schedule) -> str:
    return f"{sched.name}: {sched.ranks} ranks, {sched.stages} stages, {sched.microbatches} micro-batches"


def draw_panels(path: str | os.PathLike[str], panels: Sequence[Panel]) -> None:
    """Write the timelines of ``panels``, stacked on one time axis, to ``path`` (.png or .svg)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ScheduleError(f"cannot draw to {os.fspath(path)!r}: use a .png or .svg suffix")
    cells = [_cells(p.sched, p.times) for p in panels]
    span = max((x + w for rows in cells for row in rows for x, w, _ in row), default=1.0) or 1.0
    ranks = max(p.sched.ranks for p in panels)
    slots = max(sum(len(halves(op)) for op in ops) for p in panels for ops in p.sched.ops)
    fig_w = min(max(6.0, 2.0 + 0.32 * slots), 22.0)  # width tracks op count
    fig = Figure(figsize=(fig_w, 1.2 + len(panels) * (0.7 + 0.42 * ranks)), dpi=120, layout="constrained")
    pt_per_x = (fig_w - 1.3) * 72 / span
    row_pt = 0.42 * 72 * ROW_HEIGHT
    font = min(_font_size(c, pt_per_x, row_pt) for c in cells)

    used: set[tuple[str, int]] = set()
    has_fb = False
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel, panel_cells in zip(axes, panels, cells):
        level_of, levels, level_name = _shading(panel.sched)
        panel_used, panel_fb = _draw_cells(ax, panel_cells, level_of, levels, pt_per_x, font)
        used |= panel_used
        has_fb |= panel_fb
        ax.set_xlim(0, span)
        ax.set_ylim(panel.sched.ranks - 0.5, -0.5)
        ax.set_yticks(range(panel.sched.ranks), [f"rank {r}" for r in range(panel.sched.ranks)])
        ax.set_xlabel(panel.xlabel or ("simulated time" if panel.times is not None else "time slot"))
        ax.set_title(panel.title or _default_title(panel.sched))
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.tick_params(axis="y", length=0)
        ax.tick_params(axis="x", labelbottom=True)

    # The legend follows the last panel's shading (panels normally share one schedule).
    handles = [
        Patch(facecolor=_shade(kind, level, levels), edgecolor="none",
              label=kind if levels == 1 else f"{kind}, {level_name} {level}")
        for kind in BASE_COLOURS for level in range(levels) if (kind, level) in used
    ]
    if has_fb:
        handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.4,
                             label="overlapped F & B pair"))
    fig.legend(handles=handles, loc="outside lower center", ncol=-(-len(handles) // levels),
               fontsize=8, frameon=False)
    fig.savefig(path, format=suffix[1:])


def draw_schedule(
    sched: Schedule,
    path: str | os.PathLike[str],
    *,
    result: Timed | None = None,
    title: str | None = None,
) -> None:
    """Write a timeline of ``sched`` to ``path`` (.png or .svg), at ``result``'s times if given."""
    draw_panels(path, [Panel(sched, result, title)])


__all__ = ["Panel", "Timed", "draw_panels", "draw_schedule"]
