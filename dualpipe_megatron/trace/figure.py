"""The measured timeline of one step under the simulator's plan for it, in the schedule figure's style."""

from __future__ import annotations

import os

from ..schedules.draw import Panel, draw_panels
from .analysis import PipelineReport, step_timeline
from .records import RankTrace, TraceError


def draw_measured(ranks: list[RankTrace], report: PipelineReport, path: str | os.PathLike[str],
                  step: int | None = None) -> int:
    """Draw ``step`` (default: the analysed step of median makespan) of one pipeline; returns the step."""
    analysed = {s.step: s for s in report.steps}
    chosen = report.median_step() if step is None else analysed.get(step)
    if chosen is None:
        raise TraceError(f"step {step} is not an analysed training step (choose from {sorted(analysed)})")
    sched = report.schedule
    measured = step_timeline(ranks, chosen.step)
    pred = report.prediction
    draw_panels(path, [
        Panel(sched, pred, xlabel="ms",
              title=f"{sched.name} P={sched.ranks} M={sched.microbatches}: simulated from median measured op "
                    f"costs (bubble ratio {100 * float(pred.bubble_ratio):.1f}%)"),
        Panel(sched, measured, xlabel="ms from the step's first start",
              title=f"measured, step {chosen.step} (bubble ratio {100 * chosen.bubble_ratio:.1f}%)"),
    ])
    return chosen.step


__all__ = ["draw_measured"]
