"""``python -m dualpipe_megatron.trace``: merge, analyse, draw and cost a ``--dualpipe-trace`` directory; profile GPU traces.

``profile`` reads PyTorch-profiler Chrome traces instead (``--use-pytorch-profiler``).

Bad input ends with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence

from ..schedules.cli import run_command
from ..schedules.ir import ScheduleError
from .analysis import analyze, analyze_pipeline, stage_cost_fit
from .chrome import write_chrome_trace
from .figure import draw_measured
from .kineto import read_profiles
from .kineto_figure import draw_profiles
from .kineto_report import format_profiles, profiles_json
from .records import TraceError, load, pipelines
from .report import format_report, summary


def cmd_merge(args: argparse.Namespace) -> None:
    out = args.output or Path(args.dir) / "trace.json"
    events = write_chrome_trace(load(args.dir), out)
    print(f"wrote {out} ({events} events); open it in ui.perfetto.dev or chrome://tracing")


def cmd_analyze(args: argparse.Namespace) -> None:
    reports = analyze(load(args.dir), args.skip)
    if args.json:
        print(json.dumps([summary(r) for r in reports], indent=1))
        return
    print("\n".join(format_report(r, args.per_step) for r in reports))


def cmd_draw(args: argparse.Namespace) -> None:
    groups = pipelines(load(args.dir))
    if not 0 <= args.pipeline < len(groups):
        raise TraceError(f"--pipeline {args.pipeline}: the trace has {len(groups)} pipeline(s)")
    ranks = groups[args.pipeline]
    step = draw_measured(ranks, analyze_pipeline(ranks, args.skip), args.output, args.step)
    print(f"wrote {args.output} (step {step})")


def cmd_costs(args: argparse.Namespace) -> None:
    groups = pipelines(load(args.dir))
    if not 0 <= args.pipeline < len(groups):
        raise TraceError(f"--pipeline {args.pipeline}: the trace has {len(groups)} pipeline(s)")
    fit = stage_cost_fit(groups[args.pipeline], args.skip)
    Path(args.output).write_text(json.dumps(fit.costs.to_json_obj(), indent=1) + "\n")
    print(f"wrote {args.output}: {len(fit.costs.stages)} stages of {fit.schedule.name}, F&B ratio "
          f"{float(fit.costs.fb_ratio):.3f} (medians of {fit.steps} steps, ms); simulated step "
          f"{fit.predicted_ms:.2f} ms, measured median {fit.measured_ms:.2f} ms")


def cmd_profile(args: argparse.Namespace) -> None:
    profiles = read_profiles(args.files)
    print(format_profiles(profiles))
    if args.json:
        Path(args.json).write_text(json.dumps(profiles_json(profiles), indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.figure:
        draw_profiles(profiles, args.figure)
        print(f"wrote {args.figure}")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dualpipe_megatron.trace", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("merge", help="all ranks into one Chrome/Perfetto trace JSON")
    p.add_argument("dir")
    p.add_argument("-o", "--output", help="default: DIR/trace.json")
    p.set_defaults(func=cmd_merge)
    for name, helptext in (("analyze", "measured bubble per rank vs the simulator's prediction"),
                           ("draw", "measured timeline under the simulated one")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("dir")
        p.add_argument("--skip", type=int, default=1, help="warm-up training steps left out (default 1)")
        if name == "analyze":
            p.add_argument("--per-step", action="store_true", help="also one line per step")
            p.add_argument("--json", action="store_true", help="machine-readable summary")
            p.set_defaults(func=cmd_analyze)
        else:
            p.add_argument("-o", "--output", required=True, help="FILE.png or FILE.svg")
            p.add_argument("--step", type=int, default=None, help="default: the step of median makespan")
            p.add_argument("--pipeline", type=int, default=0, help="which pipeline (0 = lowest global ranks)")
            p.set_defaults(func=cmd_draw)
    p = sub.add_parser("costs", help="per-stage op costs of a traced run, as a --stage-costs file")
    p.add_argument("dir")
    p.add_argument("-o", "--output", required=True, help="the stage-cost JSON to write")
    p.add_argument("--skip", type=int, default=1, help="warm-up training steps left out (default 1)")
    p.add_argument("--pipeline", type=int, default=0, help="which pipeline (0 = lowest global ranks)")
    p.set_defaults(func=cmd_costs)
    p = sub.add_parser("profile", help="PyTorch-profiler traces: compute, communication hidden and exposed, "
                                       "GPU time per phase")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="Chrome trace .json/.json.gz (one per rank), or a directory of them")
    p.add_argument("--json", metavar="OUT", help="also write the measurements as JSON to OUT")
    p.add_argument("--figure", metavar="PNG", help="also draw the stream lanes to this .png or .svg")
    p.set_defaults(func=cmd_profile)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(make_parser(), argv, (TraceError, ScheduleError, OSError))


__all__ = ["main", "make_parser"]
