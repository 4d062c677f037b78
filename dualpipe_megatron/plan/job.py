"""The plan of a DualPipe(V) job, checked before any GPU is used (``python -m
dualpipe_megatron.plan``: :mod:`.cli`).

ARGS are ``scripts/pretrain_gpt.py``'s arguments (the launch templates' dry runs pass theirs).
They go through Megatron's own parser with our flags and EPLB's, then through the checks a job
runs at start-up: ours before Megatron's (schedule, placement flags, FP8 without Transformer
Engine, layout; ``--dualpipe-layout auto`` is resolved there), Megatron's ``validate_args``
where CUDA is present (it reads the GPU's compute capability and TE's version; skipped, and
said so, elsewhere), then ours after it (micro-batches per step, EPLB flags, stage costs).
Nothing is built and no process group is created. The report gives the layout, each rank's
stages, parameters, weight/gradient/optimizer bytes and peak activation bytes
(:mod:`.memory`), and the step the projection predicts with its built-in costs. Peaks and
step are those of the op order the job runs, built by training's own
:func:`~..megatron.schedule.training_order`: DeepSeek's, or under ``--dualpipe-optimize-order`` /
``--dualpipe-max-activations`` the optimized one (seconds at large P and M under a budget).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..schedules.cli import CliParser, fmt
from ..schedules.ir import Schedule, ScheduleError

if TYPE_CHECKING:
    from megatron.core.transformer.enums import LayerType

    from .compare import Row
    from ..megatron.schedule import DualPipeOptions
    from ..projection.project import Projection, Variant


class Refused(Exception):
    """A start-up check refused the job; the message is the check's."""


@dataclass(frozen=True)
class Checked:
    """The arguments after every check, and how far the checks went."""

    args: argparse.Namespace
    requested_layout: str | None
    megatron_validated: bool
    options: DualPipeOptions | None  # what our schedule runs (None: Megatron's schedule)


def _have_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse(argv: Sequence[str], world_size: int) -> argparse.Namespace:
    """Megatron's parser with our flags and EPLB's, as ``pretrain()`` would build it."""
    from megatron.training.arguments import add_megatron_arguments

    from ..eplb import training as eplb_training
    from ..megatron import training_hooks

    training_hooks.register_arguments(eplb_training.add_arguments, eplb_training.validate)
    parser = CliParser(prog="pretraining arguments", allow_abbrev=False)  # a bad flag: one error line
    args = training_hooks.add_arguments(add_megatron_arguments(parser)).parse_args(list(argv))
    args.world_size, args.rank = world_size, 0
    model_parallel = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                      * args.context_parallel_size)
    if world_size % model_parallel:
        raise Refused(f"{world_size} GPUs do not divide into TP x PP x CP = {model_parallel}")
    args.data_parallel_size = world_size // model_parallel  # Megatron's validate_args sets the same
    return args


def check(args: argparse.Namespace) -> Checked:
    """Run the start-up checks in start-up order on ``args`` (changed as they change them)."""
    from megatron.training.arguments import validate_args

    from .memory import activation_options
    from ..megatron.training_hooks import active_options, post_validate, pre_validate

    requested, printed = args.dualpipe_layout, io.StringIO()
    validated = _have_cuda()
    with contextlib.redirect_stdout(printed):  # Megatron prints every argument
        try:
            pre_validate(args)
        except (ValueError, ScheduleError) as exc:  # ScheduleError: --dualpipe-layout auto's search
            raise Refused(str(exc)) from None
        if validated:
            try:
                validate_args(args, {})
            except Exception as exc:  # Megatron refuses with assertions and assorted errors
                raise Refused(f"Megatron's validate_args: {type(exc).__name__}: {exc}") from None
        else:
            args.virtual_pipeline_model_parallel_size = virtual_stages(args)
        try:
            post_validate(args)
            activation_options(args)  # the recompute flags the memory estimate reads
        except ValueError as exc:
            raise Refused(str(exc)) from None
    return Checked(args, requested, validated, active_options())


def virtual_stages(args: argparse.Namespace) -> int | None:
    """Megatron's virtual pipeline size from its two flags (what ``validate_args`` sets)."""
    if args.num_virtual_stages_per_pipeline_rank:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage:
        per_rank = args.num_layers // args.pipeline_model_parallel_size
        return per_rank // args.num_layers_per_virtual_pipeline_stage
    return None


def job_schedule(checked: Checked, microbatches: int) -> tuple[Schedule, list[list[LayerType]]]:
    """The op order the job runs and its layer types per model stage: ours as training builds
    them (:func:`~..megatron.schedule.training_order`, the layout post_validate fixed), Megatron's
    1F1B or interleaved order (its combined pairs under ``--overlap-moe-expert-parallel-comm``)
    over its own looped split."""
    from ..megatron.schedule import training_order
    from ..megatron.topology import stage_layer_types
    from ..projection.project import megatron_combined_1f1b
    from ..schedules.registry import build_schedule

    args, pp = checked.args, checked.args.pipeline_model_parallel_size
    if checked.options is not None:
        try:
            sched = training_order(checked.options, pp, microbatches)
        except ValueError as exc:  # a budget no order found meets: the job's first step would refuse it
            raise Refused(str(exc)) from None
        return sched, args.pipeline_model_parallel_layout.stage_layers
    vp = args.virtual_pipeline_model_parallel_size
    sched = build_schedule(args.pipeline_schedule, pp, microbatches, vp)
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        sched = megatron_combined_1f1b(sched)
    layout = args.pipeline_model_parallel_layout
    return sched, stage_layer_types(args.num_layers, sched.stages, layout if isinstance(layout, str) else None,
                                    args.mtp_num_layers or 0)


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _memory_lines(args: argparse.Namespace, sched: Schedule, stage_layers: list[list[LayerType]],
                  peaks: list[float]) -> list[str]:
    from .memory import GIB, ParamCounter, moe_pattern, rank_params, stage_params, state_bytes
    from ..megatron.topology import layout_text

    whole = ParamCounter(args, shard=False)
    mtp = (args.mtp_num_layers or 0) * whole.mtp(moe_pattern(args)[-1]).total
    model = sum(p.total for p in stage_params(args, stage_layers, shard=False)) - mtp
    lines = [f"parameters: {_billions(model)} B in the model" + (f" + {_billions(mtp)} B in its MTP layers" if mtp
                                                                  else "")
             + "; per rank, one TP x EP rank's share of its stages:",
             "| rank | stages | layers | params (B) | weights+grads+optimizer (GiB) | peak activations (GiB) | total (GiB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    names = layout_text(stage_layers).split("|")
    for rank, params in enumerate(rank_params(args, stage_layers, sched)):
        held = [s for _, s in sched.stages_on(rank)]
        state = state_bytes(args, params)
        lines.append(f"| {rank} | {', '.join(map(str, held))} | {' '.join(names[s] for s in held)} | "
                     f"{_billions(params.total)} | {state / GIB:.1f} | {peaks[rank] / GIB:.1f} | "
                     f"{(state + peaks[rank]) / GIB:.1f} |")
    optimizer = (f"fp32 main weights and Adam moments sharded over DP {args.data_parallel_size} (experts' over "
                 f"expert DP) by the distributed optimizer" if args.use_distributed_optimizer
                 else "fp32 main weights and Adam moments unsharded")
    lines.append(f"memory: bf16 weights, fp32 gradients, {optimizer} (Megatron's bytes per parameter); "
                 f"activations: {_activation_words(args)}, the op order's live micro-batches per rank "
                 "(docs/performance.md, \"Activation memory\")")
    return lines


def _activation_words(args: argparse.Namespace) -> str:
    """What the activation column assumed, from the flags."""
    from .memory import activation_options

    o = activation_options(args)
    precision = {4: "fp32", 2: "bf16" if args.bf16 else "fp16"}[o.act_bytes] + (" + FP8 linear inputs" if o.fp8 and o.te
                                                                              else "")
    recompute = ("no recompute" if not o.modules and o.full is None
                 else f"selective recompute of {', '.join(sorted(o.modules))}" if o.modules
                 else f"full recompute ({o.full[0]}, {o.full[1]} layer(s))")
    return f"{o.impl} layers, {precision}, {recompute}"


def _placement_parts(args: argparse.Namespace, gpus_per_node: int, op_costs: str | None) -> tuple:
    """The projection's model, its 1/P stage, that stage's op times (built-in FLOP costs, or a
    measured/calibrated op-cost file) and the F&B pairs' exposed share."""
    from .memory import projection_shapes
    from ..projection import Network, OpCosts, count_chunk, stage_times
    from ..projection.cli import DEFAULT_OVERLAP_LOSS

    model, shape = projection_shapes(args)
    chunk = count_chunk(shape)
    measured = None
    if op_costs:
        try:
            measured = OpCosts.from_json_obj(json.loads(Path(op_costs).read_text()))
        except (OSError, ValueError) as exc:
            raise Refused(f"--op-costs {op_costs}: {exc}") from None
    times = stage_times(shape, chunk, measured, None, Network(gpus_per_node=gpus_per_node))
    found = measured.exposed_share if measured else None
    return model, shape, times, chunk, DEFAULT_OVERLAP_LOSS if found is None else found


def _projection(args: argparse.Namespace, sched: Schedule, stage_layers: list[list[LayerType]],
                max_activations: int | None, gpus_per_node: int, op_costs: str | None) -> Projection:
    """The projected step of the job's order ``sched`` (made within ``max_activations``, if set),
    from the projection's public API."""
    from .memory import GivenLayout, decoder_counts
    from ..projection import project_order

    model, shape, times, chunk, loss = _placement_parts(args, gpus_per_node, op_costs)
    placement = GivenLayout(decoder_counts(stage_layers), model, shape, times, chunk, loss,
                            args.pipeline_model_parallel_size, sched.microbatches)
    return project_order(placement, _variant(args), sched, max_activations)


def _variant(args: argparse.Namespace) -> Variant:
    """The projection's row for the job's schedule."""
    from ..projection import variants

    schedule = args.pipeline_schedule
    if schedule == "interleaved":
        vp = args.virtual_pipeline_model_parallel_size
        label = f"interleaved-{vp}" + ("+a2a" if getattr(args, "overlap_moe_expert_parallel_comm", False) else "")
        return next(v for v in variants(chunks=(vp,)) if v.label == label)
    return next(v for v in variants() if v.label == schedule)


def _order(args: argparse.Namespace, options: DualPipeOptions | None) -> str:
    """The op order the job runs, in words: Megatron's, DeepSeek's, or the optimized one, for
    which costs and within which activation budget."""
    from ..megatron.schedule import order_costs
    from ..schedules.simulate import StageCosts

    if options is None:
        return f"Megatron's {args.pipeline_schedule} order"
    c = order_costs(options)
    if c is None:
        return "DeepSeek's op order"
    costs = (f"the stage costs in {args.dualpipe_stage_costs}" if isinstance(c, StageCosts)
             else f"the uniform costs F={fmt(c.F)} B={fmt(c.B)} W={fmt(c.W)} F&B={fmt(c.FB)}")
    budget = ("" if options.max_activations is None
              else f" within {options.max_activations} live stage activations per rank")
    return f"the op order optimized for {costs}{budget}"


def _step_line(args: argparse.Namespace, result: Projection | None, order: str, why: str,
               op_costs: str | None) -> str:
    from .compare import tokens_per_s_per_gpu

    if result is None:
        return f"projected step: n/a: {why}"
    step = float(result.result.makespan)
    exposed = "" if result.exposed_a2a_ms is None else f", exposed all-to-all {result.exposed_a2a_ms:,.1f} ms"
    costs = (f"the op costs in {op_costs}" if op_costs
             else "the projection's built-in costs: FLOPs at its default rate and its network model")
    return (f"projected step: {step:,.1f} ms, bubble ratio {float(result.result.bubble_ratio):.3f}{exposed}; "
            f"{tokens_per_s_per_gpu(args, step):,.0f} tokens/s/GPU ({costs}, {order}; optimizer step and data-parallel "
            f"reduction left out)")


def plan(checked: Checked, gpus_per_node: int = 8, op_costs: str | None = None) -> tuple[list[str], Row]:
    """The plan's lines (sizes, checks, layout, per-rank memory, projected step) and its one row."""
    from .compare import Row, tokens_per_s_per_gpu
    from .memory import GIB, overlapped_pairs, rank_memory
    from ..megatron.auto_layout import microbatches
    from ..megatron.topology import layout_text
    from ..projection import ProjectionError

    args = checked.args
    pp, schedule = args.pipeline_model_parallel_size, args.pipeline_schedule
    m = microbatches(args)
    megatron = ("passed" if checked.megatron_validated
                else "not run (no CUDA here: it reads the GPU's compute capability and Transformer Engine's version)")
    lines = [f"# plan: {schedule} on {args.world_size} GPUs = PP {pp} x TP {args.tensor_model_parallel_size} x "
             f"DP {args.data_parallel_size} (EP {args.expert_model_parallel_size}), {m} micro-batches per step",
             f"checks: ours passed (arguments, schedule, layout, EPLB); Megatron's validate_args {megatron}"]
    options = checked.options
    sched, stage_layers = job_schedule(checked, m)
    if options is not None:
        how = ("chosen by --dualpipe-layout auto" if checked.requested_layout == "auto"
               else "--dualpipe-layout" if checked.requested_layout else "--num-layers split evenly")
    else:
        how = "Megatron's split"
    lines.append(f"layout ({how}, {len(stage_layers)} stages): {layout_text(stage_layers)}")
    peaks, totals = rank_memory(args, sched, stage_layers, overlapped_pairs(args, schedule))
    result, why = None, ""
    try:
        result = _projection(args, sched, stage_layers, options.max_activations if options else None,
                             gpus_per_node, op_costs)
    except (ProjectionError, ScheduleError) as exc:
        why = str(exc)
    lines += _memory_lines(args, sched, stage_layers, peaks)
    lines.append(_step_line(args, result, _order(args, options), why, op_costs))
    step = float(result.result.makespan) if result else float("nan")
    vp = args.virtual_pipeline_model_parallel_size if schedule == "interleaved" else None
    return lines, Row(schedule, schedule, vp, layout_text(stage_layers), step, tokens_per_s_per_gpu(args, step),
                      [a / GIB for a in peaks], [t / GIB for t in totals], "")


def report(checked: Checked, gpus_per_node: int = 8, op_costs: str | None = None) -> list[str]:
    """The plan's lines."""
    return plan(checked, gpus_per_node, op_costs)[0]


def comparison(checked: Checked, gpus_per_node: int, op_costs: str | None, gpu_memory: float | None
               ) -> tuple[list[str], list[Row], int | None]:
    """``--compare``: the table of every schedule for this job (:mod:`.compare`)."""
    from .compare import compare, markdown
    from ..megatron.auto_layout import microbatches
    from ..projection import ProjectionError, Realistic

    args = checked.args
    m = microbatches(args)
    try:
        model, shape, times, chunk, loss = _placement_parts(args, gpus_per_node, op_costs)
    except (ProjectionError, ScheduleError) as exc:
        raise Refused(f"--compare needs the projection's model of this job: {exc}") from None
    placement = Realistic(model, shape, times, chunk, loss, args.pipeline_model_parallel_size, m)
    rows, refused, best = compare(args, placement, m, gpu_memory)
    costs = f"op costs from {op_costs}" if op_costs else "the projection's built-in costs"
    head = [f"# compare: {args.world_size} GPUs = PP {args.pipeline_model_parallel_size} x TP "
            f"{args.tensor_model_parallel_size} x DP {args.data_parallel_size} (EP {args.expert_model_parallel_size}), "
            f"{m} micro-batches per step; {costs}; memory: weights+grads+optimizer of each row's stages + "
            f"activations ({_activation_words(args)})"]
    return head + markdown(rows, refused, best, gpu_memory), rows, best
