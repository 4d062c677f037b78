"""``python -m dualpipe_megatron.schedules``: dump, simulate, compare and draw schedules.

Bad input ends with one ``error:`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from fractions import Fraction
from pathlib import Path
from typing import Sequence

from .ir import Schedule, ScheduleError
from .lower import schedule_json
from .optimize import SEARCH_WORK, optimize_order
from .registry import GENERATORS, build_schedule
from .simulate import AnyCosts, Costs, SimResult, StageCosts, simulate

COMPARED = ["1f1b", "interleaved", "zb1p", "zbv", "vhalf", "chimera", "dualpipe", "dualpipev"]


class CliParser(argparse.ArgumentParser):
    """argparse that reports usage errors on one line."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ScheduleError(f"{self.prog}: {message}")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. ``2,4``."""
    return tuple(positive_int(v) for v in text.split(","))


def _add_shape(p: argparse.ArgumentParser, with_schedule: bool = True, chunk_list: bool = False) -> None:
    if with_schedule:
        p.add_argument("--schedule", required=True, help=f"one of: {', '.join(GENERATORS)}")
    p.add_argument("--ranks", "-P", type=positive_int, required=True, help="pipeline ranks P")
    p.add_argument("--microbatches", "-M", type=positive_int, required=True,
                   help="micro-batches per step (both directions together for dualpipe)")
    if chunk_list:
        p.add_argument("--chunks", type=positive_ints, default=None,
                       help="model chunks per rank for interleaved, one row each, e.g. 2,4 "
                            "(default 2; rows are named interleaved-N unless only 2)")
    else:
        p.add_argument("--chunks", type=positive_int, default=None,
                       help="model chunks per rank for interleaved (default 2)")
    p.add_argument("--group-size", type=positive_int, default=None,
                   help="interleaved: micro-batches per chunk group (Megatron's "
                        "microbatch_group_size_per_vp_stage; default P)")


def _add_costs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--F", default="1", help="forward cost of one stage (default 1)")
    p.add_argument("--B", default="2", help="full backward cost (default 2)")
    p.add_argument("--W", default="1", help="weight-grad part of B (default 1)")
    p.add_argument("--FB", default="3", help="cost of an overlapped F&B pair (default 3)")
    p.add_argument("--c", default="0", help="p2p latency between ranks (default 0)")
    p.add_argument("--stage-costs", metavar="FILE", default=None,
                   help='per-(direction, stage) costs instead of the uniform ones: JSON {"c": .., '
                        '"fb_ratio": .., "stages": [{"d": 0, "s": 0, "F": .., "B": .., "W": ..}, ...]} '
                        "(docs/schedule_format.md; 'python -m dualpipe_megatron.trace costs' writes one)")


def _costs(args: argparse.Namespace) -> AnyCosts:
    if getattr(args, "stage_costs", None):
        try:
            obj = json.loads(Path(args.stage_costs).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ScheduleError(f"cannot read stage costs {args.stage_costs}: {exc}") from None
        return StageCosts.from_json_obj(obj)
    try:
        return Costs.of(args.F, args.B, args.W, args.FB, args.c)
    except (ValueError, ZeroDivisionError) as exc:
        raise ScheduleError(f"bad cost value: {exc}") from None


def _costs_json(costs: AnyCosts) -> dict:
    if isinstance(costs, StageCosts):
        return costs.to_json_obj()
    return {k: str(getattr(costs, k)) for k in ("F", "B", "W", "FB", "c")}


def _schedule(args: argparse.Namespace, name: str | None = None) -> Schedule:
    return build_schedule(
        name or args.schedule, args.ranks, args.microbatches, args.chunks, args.group_size
    )


def fmt(value: Fraction) -> str:
    """Exact integers stay integers; other fractions print as short decimals."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.4g}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _result_json(res: SimResult) -> dict:
    return {
        "schedule": res.schedule.name,
        "ranks": res.schedule.ranks,
        "stages": res.schedule.stages,
        "microbatches": res.schedule.microbatches,
        "costs": _costs_json(res.costs),
        "makespan": str(res.makespan),
        "max_bubble": str(res.max_bubble),
        "mean_bubble": str(res.mean_bubble),
        "min_bubble": str(res.min_bubble),
        "bubble_ratio": float(res.bubble_ratio),
        "peak_activations": res.peak_activations,
        "params_per_rank": str(res.params_per_rank),
        "model_copies": res.model_copies,
        "devices": res.schedule.ranks,
        "per_rank": [
            {"rank": r.rank, "busy": str(r.busy), "bubble": str(r.bubble),
             "peak_activations": r.peak_activations, "stages": r.stages, "ops": r.ops}
            for r in res.per_rank
        ],
    }


def cmd_dump(args: argparse.Namespace) -> None:
    sched = _schedule(args)
    for given, flag in ((args.max_activations, "--max-activations"), (args.search_work, "--search-work")):
        if given is not None and not args.optimize:
            raise ScheduleError(f"{flag} needs --optimize")
    if args.optimize:
        sched = optimize_order(sched, _costs(args), args.max_activations, args.search_work or SEARCH_WORK)
    print(sched.to_json() if args.no_programs else json.dumps(schedule_json(sched, args.forward_only)))


def cmd_simulate(args: argparse.Namespace) -> None:
    res = simulate(_schedule(args), _costs(args))
    if args.json:
        print(json.dumps(_result_json(res), indent=1))
        return
    rows = [[str(r.rank), str(r.stages), str(r.ops), fmt(r.busy), fmt(r.bubble),
             str(r.peak_activations)] for r in res.per_rank]
    print(f"{res.schedule.name}: P={res.schedule.ranks} stages={res.schedule.stages} "
          f"M={res.schedule.microbatches} makespan={fmt(res.makespan)} "
          f"max bubble={fmt(res.max_bubble)} bubble ratio={float(res.bubble_ratio):.3f}")
    print(markdown_table(["rank", "stages", "ops", "busy", "bubble", "peak act."], rows))


def compare_rows(ranks: int, microbatches: int, costs: AnyCosts,
                 chunks: Sequence[int] = (2,)) -> list[list[str]]:
    """One row per schedule at equal model and devices; a row names why a schedule is n/a.

    Uniform ``costs`` are for one rank's share of a ``ranks``-stage split; a schedule
    that cuts the model into more stages per copy (interleaved, DualPipeV) runs
    proportionally cheaper stages. Stage costs apply as given, to the schedules whose
    (direction, stage) pairs they cover. Interleaved gets one row per entry of ``chunks``
    (named ``interleaved-N`` when that is not just 2).
    """
    runs = [(n, None) for n in COMPARED if n != "interleaved"]
    at = COMPARED.index("interleaved")
    runs[at:at] = [("interleaved", v) for v in chunks]
    rows = []
    for name, v in runs:
        label = name if v is None or tuple(chunks) == (2,) else f"{name}-{v}"
        try:
            sched = build_schedule(name, ranks, microbatches, v)
            res = simulate(sched, costs if isinstance(costs, StageCosts)
                           else costs.scaled(Fraction(ranks, sched.stages)))
        except ScheduleError as exc:
            rows.append([label] + ["-"] * (len(COMPARE_HEADER) - 2) + [f"n/a: {exc}"])
            continue
        rows.append([
            label, str(res.schedule.stages), fmt(res.makespan), fmt(res.max_bubble),
            fmt(res.mean_bubble), f"{float(res.bubble_ratio):.3f}",
            str(res.peak_activations),
            fmt(res.peak_activations * Fraction(ranks, sched.stages)),
            fmt(res.params_per_rank), str(res.model_copies), "",
        ])
    return rows


COMPARE_HEADER = ["schedule", "stages", "makespan", "max bubble", "mean bubble",
                  "bubble ratio", "peak act. (stages)", "peak act. memory", "params/rank",
                  "model copies", "note"]


def cmd_compare(args: argparse.Namespace) -> None:
    costs = _costs(args)
    if isinstance(costs, StageCosts):
        what = (f"stage costs from {args.stage_costs} ({len(costs.stages)} stages, F&B ratio "
                f"{fmt(costs.fb_ratio)}, c={fmt(costs.c)}), for the schedules with those stages")
    else:
        what = (f"F={fmt(costs.F)} B={fmt(costs.B)} W={fmt(costs.W)} F&B={fmt(costs.FB)} "
                f"c={fmt(costs.c)}; costs are for 1/P of the model and scale with stage size")
    print(f"P={args.ranks} devices, M={args.microbatches} micro-batches, {what};\n"
          f"peak act. memory is in units of one 1/P-of-the-model stage; params/rank is a share "
          f"of the model")
    chunks = args.chunks or (2,)
    print(markdown_table(COMPARE_HEADER, compare_rows(args.ranks, args.microbatches, costs, chunks)))


def cmd_draw(args: argparse.Namespace) -> None:
    from .draw import draw_schedule  # matplotlib is only needed here

    sched = _schedule(args)
    result = simulate(sched, _costs(args)) if args.timed else None
    draw_schedule(sched, args.output, result=result)
    print(f"wrote {args.output}")


def make_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="dualpipe-schedules", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    p = sub.add_parser("dump", help="print the schedule as contract JSON, with its per-rank programs")
    _add_shape(p)
    _add_costs(p)
    p.add_argument("--optimize", action="store_true",
                   help="reorder the ops for these costs (--stage-costs or the uniform ones): never "
                        "a longer simulated step nor a higher per-rank activation peak than the input")
    p.add_argument("--max-activations", metavar="K", type=positive_int, default=None,
                   help="with --optimize: the fastest order found with at most K live activations "
                        "((direction, stage, micro-batch) units) on every rank, even if slower than the input")
    p.add_argument("--search-work", metavar="N", type=positive_int, default=None,
                   help=f"with --optimize: the search's work bound in op-simulations (default {SEARCH_WORK}); "
                        "more finds better orders, in proportion slower")
    p.add_argument("--forward-only", action="store_true",
                   help="lower the per-rank programs ('programs') for a forward-only step (default: training)")
    p.add_argument("--no-programs", action="store_true",
                   help="leave out 'programs' and 'forward_only' (a reader lowers the ops itself when it needs them)")
    p.set_defaults(func=cmd_dump)
    p = sub.add_parser("simulate", help="per-rank timing table of one schedule")
    _add_shape(p)
    _add_costs(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("compare", help="one table over all schedules at equal devices")
    _add_shape(p, with_schedule=False, chunk_list=True)
    _add_costs(p)
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("draw", help="draw the timeline to a PNG or SVG file")
    _add_shape(p)
    _add_costs(p)
    p.add_argument("-o", "--output", required=True, help="FILE.png or FILE.svg")
    p.add_argument("--timed", action="store_true",
                   help="place ops at simulated times (with the costs) instead of unit slots")
    p.set_defaults(func=cmd_draw)
    from .layout_cli import add_layout_parser

    add_layout_parser(sub)
    return parser


def run_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                errors: tuple[type[Exception], ...]) -> int:
    """Parse and run a subcommand (``args.func``); one ``error:`` line and status 2 for ``errors``."""
    try:
        args = parser.parse_args(argv)
        args.func(args)
    except errors as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (| head): not our error
        sys.stdout = open(os.devnull, "w")
        return 0
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(make_parser(), argv, (ScheduleError,))


if __name__ == "__main__":
    raise SystemExit(main())
