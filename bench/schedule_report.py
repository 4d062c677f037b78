"""Turning the ranks' raw measurements into per-schedule figures and a markdown table.

Every figure is a median over the timed rounds with its min–max. A round runs each
schedule once, back to back, so ratios are taken round by round ("pair by pair"):
slow phases of a shared machine hit both members of a pair.
"""

from __future__ import annotations

from statistics import median
from typing import Any, Sequence

from dualpipe_megatron.schedules.cli import markdown_table

REFERENCE = "1f1b"
PLAIN_PAIR = ("torch_dualpipev", "plain_dualpipev")
HEADER = ["config", "schedule", "step ms: median (min–max)", "tokens/s", "÷ Megatron 1F1B, pair by pair",
          "bubble: median (min–max)", "CPU s/step, all ranks", "peak activation bytes/rank (max)",
          "parameter bytes/rank (max)"]
PAIR_HEADER = ["config", "torch ScheduleDualPipeV ÷ our native Pipeline (plain modules), pair by pair"]
LABELS = {
    "1f1b": "Megatron 1F1B",
    "interleaved": "Megatron interleaved (VPP=2)",
    "interleaved-4": "Megatron interleaved (VPP=4)",
    "dualpipev": "ours dualpipev",
    "dualpipe": "ours dualpipe",
    "dualpipev-tuned": "ours dualpipev, auto layout + order optimized for measured stage costs",
    "torch_dualpipev": "torch ScheduleDualPipeV (plain modules)",
    "plain_dualpipev": "ours dualpipev, native Pipeline (plain modules)",
}


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": median(values), "min": min(values), "max": max(values)}


def _bubbles(ranks: list[dict[str, Any]]) -> list[float]:
    """Per round: the mean over ranks of the share of the fenced step not spent computing."""
    rounds = len(ranks[0]["seconds"])
    return [sum(1 - r["busy"][i] / r["seconds"][i] for r in ranks) / len(ranks) for i in range(rounds)]


def summarize(per_rank: list[dict[str, dict[str, Any]]], tokens_per_step: int) -> dict[str, dict[str, Any]]:
    """Figures per schedule from every rank's :meth:`Variant.summary`; times are rank 0's."""
    out: dict[str, dict[str, Any]] = {}
    reference = per_rank[0].get(REFERENCE, {}).get("seconds")
    for name, first in per_rank[0].items():
        ranks = [r[name] for r in per_rank]
        seconds = first["seconds"]
        row: dict[str, Any] = {
            "step_ms": spread([s * 1e3 for s in seconds]),
            "tokens_per_s": tokens_per_step / median(seconds),
            "bubble": spread(_bubbles(ranks)),
            "cpu_s_all_ranks": spread([sum(r["cpu_seconds"][i] for r in ranks) for i in range(len(seconds))]),
            "peak_activation_bytes": [r["peak_activation_bytes"] for r in ranks],
            "param_bytes": [r["param_bytes"] for r in ranks],
            "step_ms_all": [s * 1e3 for s in seconds],
            "busy_ms_per_rank": [[b * 1e3 for b in r["busy"]] for r in ranks],
        }
        if reference:
            row["ratio_to_1f1b"] = spread([s / ref for s, ref in zip(seconds, reference)])
        out[name] = row
    if all(n in out for n in PLAIN_PAIR):
        theirs, ours = (per_rank[0][n]["seconds"] for n in PLAIN_PAIR)
        out[PLAIN_PAIR[0]]["ratio_to_plain_dualpipev"] = spread([t / o for t, o in zip(theirs, ours)])
    return out


def _fmt(s: dict[str, float], digits: int = 0, pct: bool = False) -> str:
    scale = 100 if pct else 1
    unit = "%" if pct else ""
    return (f"{s['median'] * scale:.{digits}f}{unit} "
            f"({s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f})")


def markdown(configs: list[dict[str, Any]]) -> str:
    """The main table, then torch's DualPipeV against ours on the plain model."""
    rows, pairs = [], []
    for config in configs:
        for name, row in config["schedules"].items():
            ratio = _fmt(row["ratio_to_1f1b"], 2) if "ratio_to_1f1b" in row else "–"
            rows.append([config["name"], LABELS.get(name, name), _fmt(row["step_ms"]),
                         f"{row['tokens_per_s']:,.0f}", ratio, _fmt(row["bubble"], 1, pct=True),
                         f"{row['cpu_s_all_ranks']['median']:.2f}", f"{max(row['peak_activation_bytes']):,}",
                         f"{max(row['param_bytes']):,}"])
            if "ratio_to_plain_dualpipev" in row:
                pairs.append([config["name"], _fmt(row["ratio_to_plain_dualpipev"], 2)])
    text = markdown_table(HEADER, rows)
    if pairs:
        text += "\n\n" + markdown_table(PAIR_HEADER, pairs)
    return text
