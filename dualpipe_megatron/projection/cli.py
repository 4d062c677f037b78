"""``python -m dualpipe_megatron.projection``: measure or calibrate op costs, project a DeepSeek-V3-like job.

Bad input ends with one ``error:`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import torch

from ..schedules.cli import CliParser, positive_int, run_command
from ..schedules.ir import ScheduleError
from ..schedules.model_shape import ModelShape
from ..schedules.simulate import StageCosts
from ..trace.kineto import read_profiles
from ..trace.records import TraceError
from .calibrate import calibrate
from .comm import Network
from .costs import DEFAULT_TFLOPS, StageTimes, overlapped_fb, stage_times
from .count import ChunkCount, count_chunk
from .measure import OpCosts, measure
from .placement import FromFile, Placement, Realistic, Uniform
from .project import project, variants
from .report import assumptions_text, inputs_text, json_doc, markdown, rows
from .shapes import (DEEPSEEK_V3, DEEPSEEK_V3_STAGE, PRESETS, ProjectionError, check_stage, dense_layers,
                     stage_shape, whole_model)


DEFAULT_OVERLAP_LOSS = 0.1  # assumed when nothing measured it


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_number(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def _unit_interval(text: str) -> float:
    value = _number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number within [0, 1], got {text}")
    return value


def _write_json(path: str, doc: object) -> None:
    try:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        raise ProjectionError(f"cannot write {path}: {exc.strerror}") from None


def cmd_measure(args: argparse.Namespace) -> None:
    overrides = {k: v for k, v in (("num_layers", args.layers), ("seq", args.seq)) if v}
    shape = check_stage(replace(PRESETS[args.preset], **overrides))
    on_cpu = args.device == "cpu" or not torch.cuda.is_available()
    if on_cpu or args.threads:
        torch.set_num_threads(args.threads or 1)
    costs = measure(shape, args.device, args.dtype, args.repeats, args.warmup)
    _write_json(args.output, costs.to_json_obj())
    ms = ", ".join(f"{op} {v:.3f}" for op, v in costs.ms.items())
    print(f"{costs.device}, {costs.dtype}, preset {args.preset} ({shape.num_layers} layers, "
          f"hidden {shape.hidden}, {shape.micro_batch}x{shape.seq} tokens): median ms {ms}; "
          f"wrote {args.output}")


_JOB_FLAGS = {"ep": "ep", "seq": "seq", "mbs": "micro_batch", "hidden": "hidden", "topk": "topk"}


def _shape(args: argparse.Namespace, base: ModelShape) -> ModelShape:
    """``base`` with the job flags given (``--ep``, ``--seq``, ``--mbs``, ``--hidden``, ``--topk``)."""
    return check_stage(replace(base, **{name: getattr(args, flag) for flag, name in _JOB_FLAGS.items()
                                        if getattr(args, flag) is not None}))


def cmd_calibrate(args: argparse.Namespace) -> None:
    shape = _shape(args, DEEPSEEK_V3_STAGE if args.preset == "deepseek-v3" else PRESETS[args.preset])
    costs = calibrate(read_profiles(args.traces), shape, args.layers_per_chunk)
    _write_json(args.output, costs.to_json_obj())
    ms, comm, info = costs.ms, costs.comm_ms or {}, costs.info
    print(f"{costs.device}, {info['ranks']} rank(s), {info['naming']}; per layer, ms: "
          + ", ".join(f"{op} {v:.2f}" for op, v in ms.items())
          + (f"; all-to-all forward {comm['forward']:.2f}, backward {comm['backward']:.2f}" if comm else "")
          + ("" if costs.exposed_share is None else f"; exposed share of a pair {costs.exposed_share:.4f}"))
    pair = info["pair_measured_ms"]
    if pair:
        layers = info["pair_layers"] / info["pairs"]
        comm_ms = layers * sum(comm.values())
        got = overlapped_fb(layers * ms["F_then_B"], comm_ms, costs.exposed_share or 0.0)
        busy = pair["compute"] + pair["exposed_communication"]
        print(f"F&B pair of {layers:g} layers: projected from these costs {got:.1f} ms; measured "
              f"{busy:.1f} ms busy (compute + exposed communication), {pair['window']:.1f} ms window "
              f"({got / pair['window'] - 1:+.1%})")
    print(f"wrote {args.output} (shape: {args.preset} with the flags given, one layer)")


def _read_json(path: str) -> object:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProjectionError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ProjectionError(f"{path} is not JSON: {exc}") from None


def _load(path: str) -> OpCosts:
    return OpCosts.from_json_obj(_read_json(path))


def _chunks(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected chunk counts like 2,4, got {text!r}") from None
    if any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"interleaved needs 2 or more chunks, got {text}")
    return values


def _budgets(text: str) -> tuple[Fraction, ...]:
    try:
        values = tuple(Fraction(v) for v in text.split(","))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected fractions of the peak like 1,0.75,0.5, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"budgets must be positive fractions of the peak, got {text}")
    return values


def _placement(args: argparse.Namespace, target: ModelShape, times: StageTimes,
               chunk: ChunkCount) -> tuple[Placement, str]:
    if args.stage_costs:
        if args.placement != "uniform":
            raise ProjectionError("--stage-costs gives the stages itself; drop --placement")
        costs = StageCosts.from_json_obj(_read_json(args.stage_costs))
        return FromFile(costs, args.ranks), (f"stage costs from {args.stage_costs} "
                                             f"({len(costs.stages)} stages, cut evenly per schedule)")
    if args.placement == "uniform":
        return (Uniform(times, args.overlap_loss, args.ranks),
                f"uniform (every stage an equal share of {args.ranks} x {target.num_layers} MoE layers)")
    model = whole_model(target, args.num_layers, args.dense_layers, args.mtp_layers, args.vocab, args.dense_ffn)
    return (Realistic(model, target, times, chunk, args.overlap_loss, args.ranks, args.microbatches),
            f"realistic ({model.num_layers} layers, the first {args.dense_layers} dense, "
            f"{model.mtp_layers} MTP, vocabulary {model.vocab}, dense FFN {model.ffn}; embedding "
            f"on the first stage, output layer + loss and MTP on the last, or in Megatron's auto "
            f"layouts the loss alone on the last and MTP on the one before)")


def cmd_project(args: argparse.Namespace) -> None:
    target = stage_shape(_shape(args, DEEPSEEK_V3), args.layers_per_rank)
    net = Network(**{f.name: getattr(args, f.name) for f in fields(Network)})
    measured = _load(args.op_costs) if args.op_costs else None
    if args.overlap_loss is None:  # the file's measured share, else the assumed default
        found = measured.exposed_share if measured else None
        args.overlap_loss = DEFAULT_OVERLAP_LOSS if found is None else found
    chunk = count_chunk(target)
    times = stage_times(target, chunk, measured, args.tflops, net)
    placement, described = _placement(args, target, times, chunk)
    realistic = isinstance(placement, Realistic)
    table = rows(project(placement, args.ranks, args.microbatches,
                         variants(args.chunks, auto_layout=realistic, budgets=args.budgets)), chunk,
                 args.microbatches * target.tokens / args.ranks)
    print(inputs_text(target, times, net, args.ranks, args.microbatches, args.chunks,
                      args.overlap_loss, described))
    print()
    print(markdown(table))
    print()
    print("Assumptions:")
    print(assumptions_text(realistic))
    if args.json:
        _write_json(args.json, json_doc(target, times, net, args.ranks, args.microbatches,
                                        args.chunks, args.overlap_loss, table, args.op_costs,
                                        described))


def make_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="dualpipe-projection", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)

    p = sub.add_parser("measure", help="time F, B, B(w=false), W and F-then-B of one chunk")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="layer shape to measure (default cpu; h200: full-width, 2 layers)")
    p.add_argument("--layers", type=positive_int, help="MoE layers in the chunk (preset's)")
    p.add_argument("--seq", type=positive_int, help="sequence length (preset's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the GPU when torch sees one")
    p.add_argument("--dtype", default="auto",
                   help="torch dtype name; auto: bfloat16 on a GPU, float32 on a CPU")
    p.add_argument("--repeats", type=positive_int, default=9, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads (default 1 on a CPU: timed by process CPU time, which a "
                        "busy host does not inflate; more threads are timed by wall clock)")
    p.add_argument("-o", "--output", required=True, help="op-cost JSON to write")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("calibrate", help="op costs from a GPU profiler trace (ours or DeepSeek's)")
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="PyTorch-profiler Chrome traces (.json, .json.gz, or directories of them)")
    p.add_argument("--layers-per-chunk", type=positive_int, default=None,
                   help="layers per pipeline stage of the traced run: needed for our dualpipe "
                        "op ranges (each holds one chunk); DeepSeek's sub-layer ranges count them")
    p.add_argument("--preset", choices=["deepseek-v3", *sorted(PRESETS)], default="deepseek-v3",
                   help="the traced layer's shape (default deepseek-v3; the trace does not say it)")
    for flag in ("ep", "seq", "mbs", "hidden", "topk"):
        p.add_argument("--" + flag, type=positive_int, default=None, help="override the preset's")
    p.add_argument("-o", "--output", required=True, help="op-cost JSON to write")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("project", help="table of step time and bubble per schedule")
    p.add_argument("--op-costs", help="JSON from `measure` or `calibrate`; its measured all-to-all "
                                      "and exposed share replace the network model and "
                                      "--overlap-loss's default; default: built-in FLOP-based costs")
    p.add_argument("--tflops", type=_positive_number, default=None,
                   help=f"built-in costs: achieved TFLOP/s (default {DEFAULT_TFLOPS:g}); with "
                        "--op-costs: rescale so F runs at this rate, keeping measured ratios")
    job = p.add_argument_group("job (DeepSeek-V3-like)")
    job.add_argument("--ranks", "-P", type=positive_int, default=16, help="pipeline ranks")
    job.add_argument("--microbatches", "-M", type=positive_int, default=48,
                     help="micro-batches per step, all schedules (DualPipe: half per direction)")
    job.add_argument("--chunks", type=_chunks, default=(2, 4),
                     help="interleaved chunks per rank, one row pair each (default 2,4)")
    job.add_argument("--budgets", type=_budgets, default=(), metavar="F,F,...",
                     help="also DualPipeV with the op-order optimizer under activation budgets, one "
                          "row each: K = ceil(F x DeepSeek's order's largest per-rank peak of live "
                          "(d,s,m)), raised to the minimum any order needs (e.g. 1,0.75,0.5)")
    job.add_argument("--ep", type=positive_int, default=None,
                     help=f"expert parallel (default {DEEPSEEK_V3.ep})")
    job.add_argument("--layers-per-rank", type=positive_int, default=DEEPSEEK_V3_STAGE.num_layers,
                     help="MoE layers in 1/P of the model")
    job.add_argument("--seq", type=positive_int, default=None, help=f"default {DEEPSEEK_V3.seq}")
    job.add_argument("--mbs", type=positive_int, default=None,
                     help=f"micro-batch size (default {DEEPSEEK_V3.micro_batch})")
    job.add_argument("--hidden", type=positive_int, default=None, help=f"default {DEEPSEEK_V3.hidden}")
    job.add_argument("--topk", type=positive_int, default=None, help=f"default {DEEPSEEK_V3.topk}")
    place = p.add_argument_group("placement of the model's layers")
    place.add_argument("--placement", choices=["uniform", "realistic"], default="uniform",
                       help="uniform (default): every stage an equal share of MoE layers; "
                            "realistic: the whole model layer by layer (embedding on the first "
                            "stage, dense layers first, output layer + loss and MTP on the last), "
                            "Megatron's schedules split as with --account-for-embedding/loss-in-"
                            "pipeline-split, interleaved+a2a also with the auto layout (the loss "
                            "may stand alone), DualPipe(V) also with the auto layout and the "
                            "op-order optimizer")
    place.add_argument("--stage-costs", metavar="FILE", default=None,
                       help="the simulator's stage-cost JSON for direction 0's stages of one model "
                            "copy in model order (ms); each schedule cuts them evenly")
    v3 = DEEPSEEK_V3
    for flag, dest, text, default in (("--num-layers", "num_layers", "decoder layers", v3.num_layers),
                                      ("--dense-layers", "dense_layers", "leading dense layers", dense_layers(v3)),
                                      ("--mtp-layers", "mtp_layers", "MTP layers", v3.mtp_layers),
                                      ("--vocab", "vocab", "vocabulary size", v3.vocab),
                                      ("--dense-ffn", "dense_ffn", "dense layers' FFN width", v3.ffn)):
        place.add_argument(flag, dest=dest, type=int, default=default, help=f"realistic: {text} (default {default})")
    net = p.add_argument_group("network (achieved GB/s per GPU)")
    default = Network()
    for f in fields(Network):
        kind = positive_int if f.type in (int, "int") else _number
        net.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind,
                         default=getattr(default, f.name), help=f"default {getattr(default, f.name)}")
    p.add_argument("--overlap-loss", type=_unit_interval, default=None,
                   help="share of the shorter of compute and all-to-all left exposed in an F&B "
                        "pair (0: perfect overlap, 1: none; default: the op-cost file's measured "
                        f"exposed share, else {DEFAULT_OVERLAP_LOSS})")
    p.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    p.set_defaults(func=cmd_project)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(make_parser(), argv, (ProjectionError, ScheduleError, TraceError))


if __name__ == "__main__":
    raise SystemExit(main())
