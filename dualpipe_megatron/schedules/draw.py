"""Timeline pictures of a schedule, in the style of DeepSeek's DualPipe figure.

One row per rank, one coloured cell per op, labelled with its micro-batch.
Without a :class:`SimResult` cells sit in unit slots, which shows op order
alone; with one they sit at their simulated times, which shows the bubbles.
Only the object-oriented Matplotlib API is used, so drawing never needs a
display and never touches pyplot's global state.
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from .ir import B, F, FB, Op, Schedule, ScheduleError, W, halves
from .simulate import SimResult

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


def _cells(sched: Schedule, result: SimResult | None) -> list[list[tuple[float, float, Op]]]:
    """(x0, width, op) per op per rank: unit slots (FB is two), or simulated times."""
    if result is not None and [len(r) for r in result.start] != [len(r) for r in sched.ops]:
        raise ScheduleError("draw_schedule: result does not belong to this schedule")
    rows = []
    for rank, ops in enumerate(sched.ops):
        row, x = [], 0.0
        for i, op in enumerate(ops):
            if result is None:
                width = float(len(halves(op)))
            else:
                x = float(result.start[rank][i])
                width = float(result.end[rank][i]) - x
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


def draw_schedule(
    sched: Schedule,
    path: str | os.PathLike[str],
    *,
    result: SimResult | None = None,
    title: str | None = None,
) -> None:
    """Write a timeline of ``sched`` to ``path`` (.png or .svg)."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ScheduleError(f"cannot draw to {os.fspath(path)!r}: use a .png or .svg suffix")
    cells = _cells(sched, result)
    span = max((x + w for row in cells for x, w, _ in row), default=1.0) or 1.0

    # Shade by direction when there are two, else by the stage's chunk index on its rank.
    two_dirs = sched.directions == 2
    chunk = {ds: sched.stages_on(r).index(ds) for ds, r in sched.placement.items()}
    levels = 2 if two_dirs else max(chunk.values(), default=0) + 1
    level_name = "dir" if two_dirs else "chunk"

    slots = max(sum(len(halves(op)) for op in ops) for ops in sched.ops)  # width tracks op count
    fig_w = min(max(6.0, 2.0 + 0.32 * slots), 22.0)
    fig_h = 1.9 + 0.42 * sched.ranks
    fig = Figure(figsize=(fig_w, fig_h), dpi=120, layout="constrained")
    ax = fig.add_subplot()
    pt_per_x = (fig_w - 1.3) * 72 / span
    row_pt = (fig_h - 1.9) * 72 / sched.ranks * ROW_HEIGHT
    font = _font_size(cells, pt_per_x, row_pt)

    used: set[tuple[str, int]] = set()
    has_fb = False
    for rank, row in enumerate(cells):
        y = rank - ROW_HEIGHT / 2
        for x, width, op in row:
            parts = halves(op)
            part_w = width / len(parts)
            for j, half in enumerate(parts):
                kind = _kind(half)
                level = half.key.d if two_dirs else chunk[(half.key.d, half.key.s)]
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

    ax.set_xlim(0, span)
    ax.set_ylim(sched.ranks - 0.5, -0.5)
    ax.set_yticks(range(sched.ranks), [f"rank {r}" for r in range(sched.ranks)])
    ax.set_xlabel("simulated time" if result is not None else "time slot")
    if title is None:
        title = (f"{sched.name}: {sched.ranks} ranks, {sched.stages} stages, "
                 f"{sched.microbatches} micro-batches")
    ax.set_title(title)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)

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


__all__ = ["draw_schedule"]
