"""Text and JSON forms of :class:`~dualpipe_megatron.trace.analysis.PipelineReport`."""

from __future__ import annotations

from statistics import median
from typing import Any

from .analysis import PipelineReport


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%"


def summary(report: PipelineReport) -> dict[str, Any]:
    """Medians over the analysed steps, next to the prediction (ms; ratios as fractions)."""
    steps, pred = report.steps, report.prediction
    ranks = len(steps[0].busy)
    makespan = median(s.makespan for s in steps)
    return {
        "pipeline": list(report.pipeline),
        "schedule": report.schedule.name, "ranks": report.schedule.ranks,
        "microbatches": report.schedule.microbatches,
        "steps_analysed": len(steps), "steps_skipped": report.skipped,
        "op_median_ms": report.op_medians,
        "costs_ms": {k: float(getattr(report.costs, k)) for k in ("F", "B", "W", "FB")},
        "measured": {
            "makespan_ms": makespan,
            "bubble_ms": [median(s.bubble[r] for s in steps) for r in range(ranks)],
            "bubble_fraction": [median(s.bubble[r] / s.makespan for s in steps) for r in range(ranks)],
            "p2p_wait_ms": [median(s.wait[r] for s in steps) for r in range(ranks)],
            "bubble_ratio": report.measured_ratio,
        },
        "predicted": {
            "makespan_ms": float(pred.makespan),
            "bubble_ms": [float(r.bubble) for r in pred.per_rank],
            "bubble_fraction": [float(r.bubble / pred.makespan) for r in pred.per_rank],
            "bubble_ratio": report.predicted_ratio,
        },
    }


def format_report(report: PipelineReport, per_step: bool = False) -> str:
    """A table per pipeline: measured (median over steps) against predicted, per rank."""
    s = summary(report)
    meas, pred = s["measured"], s["predicted"]
    costs = " ".join(f"{k}={v:.2f}" for k, v in s["costs_ms"].items())
    medians = ", ".join(f"{k} {v:.2f}" for k, v in s["op_median_ms"].items())
    lines = [
        f"pipeline of global ranks {s['pipeline']}: {s['schedule']} P={s['ranks']} M={s['microbatches']}, "
        f"{s['steps_analysed']} training steps analysed ({s['steps_skipped']} skipped)",
        f"  median op compute (ms): {medians}",
        f"  simulator costs from them (ms): {costs}, p2p latency 0",
        "  | rank | measured bubble (ms) | measured bubble | p2p wait (ms) | predicted bubble (ms) | predicted bubble |",
        "  |---|---|---|---|---|---|",
    ]
    for r in range(s["ranks"]):
        lines.append(f"  | {r} | {meas['bubble_ms'][r]:.1f} | {100 * meas['bubble_fraction'][r]:.1f}% | "
                     f"{meas['p2p_wait_ms'][r]:.1f} | {pred['bubble_ms'][r]:.1f} | "
                     f"{100 * pred['bubble_fraction'][r]:.1f}% |")
    lines.append(f"  step makespan: measured {meas['makespan_ms']:.1f} ms, predicted {pred['makespan_ms']:.1f} ms; "
                 f"bubble ratio (idle share of all rank-time): measured {100 * meas['bubble_ratio']:.1f}%, "
                 f"predicted {100 * pred['bubble_ratio']:.1f}%")
    if per_step:
        lines.append("  per step: makespan ms | bubble ms (share) per rank")
        for step in report.steps:
            ranks = "  ".join(f"{b:.1f} ({_pct(b, step.makespan)})" for b in step.bubble)
            lines.append(f"    step {step.step}: {step.makespan:.1f} | {ranks}")
    return "\n".join(lines)


__all__ = ["format_report", "summary"]
