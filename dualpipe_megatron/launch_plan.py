"""``python -m dualpipe_megatron.launch_plan --world-size N [--gpus-per-node G] -- ARGS``: the
plan of a DualPipe(V) job, checked before any GPU is used.

ARGS are ``scripts/pretrain_gpt.py``'s arguments (the launch templates' dry runs pass theirs).
They go through Megatron's own parser with our flags and EPLB's, then through the checks a job
runs at start-up: ours before Megatron's (schedule, placement flags, FP8 without Transformer
Engine, layout; ``--dualpipe-layout auto`` is resolved there), Megatron's ``validate_args``
where CUDA is present (it reads the GPU's compute capability and TE's version; skipped, and
said so, elsewhere), then ours after it (micro-batches per step, EPLB flags, stage costs).
Nothing is built and no process group is created. The report gives the layout, each rank's
stages, parameters, weight/gradient/optimizer bytes and peak activation bytes
(:mod:`.launch_memory`), and the step the projection predicts with its built-in costs. Peaks and
step are those of the op order the job runs, built by training's own
:func:`~.megatron.schedule.training_order`: DeepSeek's, or under ``--dualpipe-optimize-order`` /
``--dualpipe-max-activations`` the optimized one (seconds at large P and M under a budget).

Exit status 0 with the report; 1 with ``refused: ...`` when a check refuses the job (the
message is the check's own); 2 for bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from .schedules.cli import CliParser, fmt, positive_int
from .schedules.ir import Schedule, ScheduleError

if TYPE_CHECKING:
    from .megatron.schedule import DualPipeOptions
    from .projection.project import Projection

OVERLAP_LOSS = 0.1  # the projection command's default share of an F&B pair's all-to-all left exposed


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

    from .eplb import training as eplb_training
    from .megatron import training_support

    training_support.register_arguments(eplb_training.add_arguments, eplb_training.validate)
    parser = CliParser(prog="pretraining arguments", allow_abbrev=False)  # a bad flag: one error line
    args = training_support.add_arguments(add_megatron_arguments(parser)).parse_args(list(argv))
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

    from .megatron.training_support import active_options, post_validate, pre_validate

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
        try:
            post_validate(args)
        except ValueError as exc:
            raise Refused(str(exc)) from None
    return Checked(args, requested, validated, active_options())


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _memory_lines(args: argparse.Namespace, peaks: list[float] | None, why: str) -> list[str]:
    from .launch_memory import GIB, ParamCounter, moe_pattern, rank_params, stage_params, state_bytes

    layout = args.pipeline_model_parallel_layout
    whole = ParamCounter(args, shard=False)
    mtp = (args.mtp_num_layers or 0) * whole.mtp(moe_pattern(args)[-1]).total
    model = sum(p.total for p in stage_params(args, layout, shard=False)) - mtp
    lines = [f"parameters: {_billions(model)} B in the model" + (f" + {_billions(mtp)} B in its MTP layers" if mtp
                                                                  else "")
             + "; per rank, one TP x EP rank's share of its two stages:",
             "| rank | stages | layers | params (B) | weights+grads+optimizer (GiB) | peak activations (GiB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    stage_map, names = layout.stage_map, repr(layout).split("|")
    for rank, params in enumerate(rank_params(args, layout)):
        held = [stage_map.stage(rank, c) for c in range(stage_map.chunks)]
        act = "-" if peaks is None else f"{peaks[rank] / GIB:.1f}"
        lines.append(f"| {rank} | {', '.join(map(str, held))} | {' '.join(names[s] for s in held)} | "
                     f"{_billions(params.total)} | {state_bytes(args, params) / GIB:.1f} | {act} |")
    optimizer = (f"fp32 main weights and Adam moments sharded over DP {args.data_parallel_size} (experts' over "
                 f"expert DP) by the distributed optimizer" if args.use_distributed_optimizer
                 else "fp32 main weights and Adam moments unsharded")
    lines.append(f"memory: bf16 weights, fp32 gradients, {optimizer} (Megatron's bytes per parameter); "
                 "activations: " + ("the simulator's live micro-batches per rank x the projection's saved bytes "
                                    "per layer (bf16, flash attention, no recompute, FP8 caches left out; each "
                                    "output head keeps fp32 logits)" if peaks is not None else f"n/a: {why}"))
    return lines


def _projection(args: argparse.Namespace, sched: Schedule, max_activations: int | None, gpus_per_node: int
                ) -> tuple[list[float], Projection]:
    """Per-rank activation peaks and the projected step of the job's order ``sched`` (made within
    ``max_activations``, if set), from the projection's public API."""
    from .launch_memory import GivenLayout, activation_peaks, decoder_counts, projection_shapes
    from .projection import Network, count_chunk, project_order, stage_times, variants

    model, shape = projection_shapes(args)
    chunk = count_chunk(shape)
    times = stage_times(shape, chunk, None, None, Network(gpus_per_node=gpus_per_node))
    pp = args.pipeline_model_parallel_size
    placement = GivenLayout(decoder_counts(args.pipeline_model_parallel_layout), model, shape, times,
                            chunk, OVERLAP_LOSS, pp, sched.microbatches)
    row = next(v for v in variants() if v.label == args.pipeline_schedule)
    return (activation_peaks(placement, sched, chunk.saved_bytes),
            project_order(placement, row, sched, max_activations))


def _order(args: argparse.Namespace, options: DualPipeOptions) -> str:
    """The op order the job runs, in words: DeepSeek's, or the optimized one, for which costs and
    within which activation budget."""
    from .megatron.schedule import order_costs
    from .schedules.simulate import StageCosts

    c = order_costs(options)
    if c is None:
        return "DeepSeek's op order"
    costs = (f"the stage costs in {args.dualpipe_stage_costs}" if isinstance(c, StageCosts)
             else f"the uniform costs F={fmt(c.F)} B={fmt(c.B)} W={fmt(c.W)} F&B={fmt(c.FB)}")
    budget = ("" if options.max_activations is None
              else f" within {options.max_activations} live stage activations per rank")
    return f"the op order optimized for {costs}{budget}"


def _step_line(args: argparse.Namespace, result: Projection | None, order: str, why: str) -> str:
    if result is None:
        return f"projected step: n/a: {why}"
    step = float(result.result.makespan)
    tokens = args.global_batch_size * args.seq_length / (step / 1000) / args.world_size
    exposed = "" if result.exposed_a2a_ms is None else f", exposed all-to-all {result.exposed_a2a_ms:,.1f} ms"
    return (f"projected step: {step:,.1f} ms, bubble ratio {float(result.result.bubble_ratio):.3f}{exposed}; "
            f"{tokens:,.0f} tokens/s/GPU (the projection's built-in costs: FLOPs at its default rate and its "
            f"network model, {order}; optimizer step and data-parallel reduction left out)")


def report(checked: Checked, gpus_per_node: int = 8) -> list[str]:
    """The plan's lines: sizes, checks, layout, per-rank memory, projected step."""
    from .megatron.auto_layout import microbatches
    from .megatron.schedule import training_order
    from .projection import ProjectionError

    args = checked.args
    pp, schedule = args.pipeline_model_parallel_size, args.pipeline_schedule
    m = microbatches(args)
    megatron = ("passed" if checked.megatron_validated
                else "not run (no CUDA here: it reads the GPU's compute capability and Transformer Engine's version)")
    lines = [f"# plan: {schedule} on {args.world_size} GPUs = PP {pp} x TP {args.tensor_model_parallel_size} x "
             f"DP {args.data_parallel_size} (EP {args.expert_model_parallel_size}), {m} micro-batches per step",
             f"checks: ours passed (arguments, schedule, layout, EPLB); Megatron's validate_args {megatron}"]
    options = checked.options
    if options is None:  # post_validate keeps none for Megatron's schedules
        return lines + [f"(--pipeline-schedule {schedule} is Megatron's: no DualPipe plan)"]
    layout = args.pipeline_model_parallel_layout
    how = ("chosen by --dualpipe-layout auto" if checked.requested_layout == "auto"
           else "--dualpipe-layout" if checked.requested_layout else "--num-layers split evenly")
    lines.append(f"layout ({how}, {layout.stage_map.num_stages} stages): {layout!r}")
    try:
        sched = training_order(options, pp, m)  # the job's own order, so the plan cannot drift from it
    except ValueError as exc:  # a budget no order found meets: the job's first step would refuse it
        raise Refused(str(exc)) from None
    peaks, result, why = None, None, ""
    try:
        peaks, result = _projection(args, sched, options.max_activations, gpus_per_node)
    except (ProjectionError, ScheduleError) as exc:
        why = str(exc)
    return lines + _memory_lines(args, peaks, why) + [_step_line(args, result, _order(args, options), why)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dualpipe_megatron.launch_plan",
                                     description="The plan of a DualPipe(V) job, checked before any GPU is used.")
    parser.add_argument("--world-size", type=positive_int, required=True, help="GPUs of the job (all nodes)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8,
                        help="GPUs per node (the projection's network model; default 8)")
    parser.add_argument("pretrain_args", nargs=argparse.REMAINDER,
                        help="-- then scripts/pretrain_gpt.py's arguments")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    rest = ns.pretrain_args[1:] if ns.pretrain_args[:1] == ["--"] else ns.pretrain_args
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Megatron's import warns about every GPU library it lacks
            lines = report(check(parse(rest, ns.world_size)), ns.gpus_per_node)
    except Refused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    except ScheduleError as exc:  # the pretraining arguments do not parse
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
