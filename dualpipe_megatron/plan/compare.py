"""``python -m dualpipe_megatron.plan --compare``: every schedule that can run the user's job, side by side.

For the parsed and checked command line: Megatron's 1F1B, its interleaved 1F1B with and without
the all-to-all overlap at each virtual size 2-4 the layers allow (and with the layout search's
split), ZB-V (an anchor: no training flag), and DualPipe and DualPipeV with the auto layout, the
optimized order and, where no DualPipeV row fits ``--gpu-memory``, DualPipeV within activation
budgets of 3/4 and 1/2 of DeepSeek's order's peak.
Each row is the projection's (:func:`~.projection.project.project`, realistic placement of this
model, its built-in costs or ``--op-costs``) with the memory of the launch plan: weights,
gradients and optimizer state of the row's own stages per rank plus the saved activations of its
op order (:mod:`.memory`), under the job's recompute and precision flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .memory import GIB, overlapped_pairs, rank_memory
from ..projection.project import Projection, Variant, project, variants
from ..schedules.ir import ScheduleError

BUDGETS = (Fraction(3, 4), Fraction(1, 2))


@dataclass(frozen=True)
class Row:
    """One schedule of the comparison."""

    label: str  # the projection's row name
    schedule: str
    vp: int | None
    layout: str
    step_ms: float
    tokens_per_s_per_gpu: float
    activation_gib: list[float]
    peak_gib: list[float]  # weights + gradients + optimizer state + activations, per rank
    flags: str  # the command-line changes that select it ("" for an anchor)
    fits: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "label": self.label, "vp": self.vp, "layout": self.layout,
                "step_ms": self.step_ms, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "activation_gib_per_rank": self.activation_gib, "peak_gib_per_rank": self.peak_gib,
                "flags": self.flags, "fits": self.fits}


def compared_variants(pp: int, stage_layers: int, budgets: tuple[Fraction, ...] = ()) -> list[Variant]:
    """The rows: the training schedules (and ZB-V), not the projection's other anchors; with
    ``budgets``, only DualPipeV's rows within those activation budgets. Interleaving needs a
    stage for each virtual stage: at most ``stage_layers`` (decoder and MTP layers, embedding and
    loss each alone)."""
    keep = ("1f1b", "interleaved", "zbv", "dualpipe auto", "dualpipev auto")
    chunks = [v for v in (2, 3, 4) if stage_layers >= pp * v]
    rows = [v for v in variants(chunks, auto_layout=True, budgets=budgets) if v.label.startswith(keep)]
    return [v for v in rows if v.budget is not None] if budgets else rows


def _flags(p: Projection) -> str:
    v = p.variant
    if v.generator == "zbv":
        return ""
    if v.generator == "1f1b":
        return "--pipeline-schedule 1f1b"
    if v.generator == "interleaved":
        out = f"--pipeline-schedule interleaved --num-virtual-stages-per-pipeline-rank {v.chunks}"
        out += " --overlap-moe-expert-parallel-comm" if v.overlap else ""
        return out + (f" --pipeline-model-parallel-layout '{p.layout}'" if v.auto_layout else "")
    out = f"--pipeline-schedule {v.generator} --dualpipe-layout auto"
    if v.budget is not None:
        return out + f" --dualpipe-max-activations {p.max_activations}"
    return out + (" --dualpipe-optimize-order" if v.optimize else "")


def _layer_types(layout: str) -> list[list[Any]]:
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return [[t if isinstance(t, LayerType) else LayerType[t.strip().lower()] for t in stage]
            for stage in PipelineParallelLayerLayout.parse_str_to_list(layout)]


def tokens_per_s_per_gpu(args: argparse.Namespace, step_ms: float) -> float:
    """The job's global batch of tokens over ``step_ms``, per GPU of the world."""
    return args.global_batch_size * args.seq_length / (step_ms / 1000) / args.world_size


def row(args: argparse.Namespace, p: Projection) -> Row:
    """A projected schedule with the job's memory on each rank."""
    stage_layers = _layer_types(p.layout)
    peaks, totals = rank_memory(args, p.order, stage_layers,
                                overlapped_pairs(args, p.variant.generator, p.variant.megatron_pairs))
    step = float(p.result.makespan)
    return Row(p.variant.label, p.variant.generator, p.variant.chunks, p.layout, step, tokens_per_s_per_gpu(args, step),
               [a / GIB for a in peaks], [t / GIB for t in totals], _flags(p))


def compare(args: argparse.Namespace, placement: Any, microbatches: int, gpu_memory: float | None
            ) -> tuple[list[Row], list[str], int | None]:
    """The rows that can run (sorted by step), the ones that cannot (with why), and the index of
    the fastest row that fits ``gpu_memory`` GiB on every rank and has a training flag."""
    pp = args.pipeline_model_parallel_size
    rows, refused = [], []

    def add(chosen: list[Variant]) -> None:
        for result in project(placement, pp, microbatches, chosen):
            if isinstance(result, ScheduleError):
                refused.append(str(result))
            else:
                rows.append(row(args, result))

    most = args.num_layers + (args.mtp_num_layers or 0) + 2
    add(compared_variants(pp, most))
    # Activation budgets (a slower search) only where they help: no DualPipeV row fits as it is.
    if gpu_memory is not None and not any(r.schedule == "dualpipev" and max(r.peak_gib) <= gpu_memory for r in rows):
        add(compared_variants(pp, most, BUDGETS))
    rows.sort(key=lambda r: r.step_ms)
    if gpu_memory is None:
        return rows, refused, None
    rows = [Row(**{**vars(r), "fits": max(r.peak_gib) <= gpu_memory}) for r in rows]
    best = next((i for i, r in enumerate(rows) if r.fits and r.flags), None)
    return rows, refused, best


def markdown(rows: list[Row], refused: list[str], best: int | None, gpu_memory: float | None) -> list[str]:
    fit = gpu_memory is not None
    lines = ["| schedule | VP | layout | step (ms) | tokens/s/GPU | peak memory per rank (GiB, max / min) |"
             + (f" fits {gpu_memory:g} GiB |" if fit else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- |" if fit else "")]
    for r in rows:
        layout = r.layout if len(r.layout) <= 40 else r.layout[:37] + "..."
        lines.append(f"| {r.label} | {r.vp or '-'} | {layout} | {r.step_ms:,.0f} | {r.tokens_per_s_per_gpu:,.0f} | "
                     f"{max(r.peak_gib):.1f} / {min(r.peak_gib):.1f} |" + (f" {'yes' if r.fits else 'no'} |" if fit
                                                                            else ""))
    lines += [f"n/a: {why}" for why in refused]
    if fit:
        lines.append(f"fastest that fits {gpu_memory:g} GiB: " + (
            f"{rows[best].label} ({rows[best].step_ms:,.0f} ms): {rows[best].flags}" if best is not None else "none"))
    return lines


__all__ = ["BUDGETS", "Row", "compare", "compared_variants", "markdown", "row", "tokens_per_s_per_gpu"]
