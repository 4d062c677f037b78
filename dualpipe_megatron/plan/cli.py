"""``python -m dualpipe_megatron.plan --world-size N [--gpus-per-node G] [--compare] -- ARGS``:
the plan (:mod:`.job`) or the comparison (:mod:`.compare`) of a job, printed and optionally written
as JSON; status 1 when the job is refused, 2 when its arguments do not parse."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Sequence

from ..schedules.cli import positive_int
from ..schedules.ir import ScheduleError
from .compare import Row
from .job import Refused, check, comparison, parse, plan


def _write_json(path: str, rows: list[Row], best: int | None) -> None:
    Path(path).write_text(json.dumps({"rows": [r.to_json() for r in rows], "fastest_that_fits": best}, indent=1,
                                     allow_nan=False, default=str))


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dualpipe_megatron.plan",
                                     description="The plan of a DualPipe(V) job, checked before any GPU is used.")
    parser.add_argument("--world-size", type=positive_int, required=True, help="GPUs of the job (all nodes)")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8,
                        help="GPUs per node (the projection's network model; default 8)")
    parser.add_argument("--compare", action="store_true",
                        help="a table of every schedule that can run the job (step, tokens/s/GPU, memory per rank)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                        help="with --compare: mark the rows that fit and name the fastest that does")
    parser.add_argument("--op-costs", default=None, metavar="FILE",
                        help="a measured or calibrated op-cost file (projection measure/calibrate) "
                             "instead of the built-in costs")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help='write {"rows": [...], "fastest_that_fits": index or null} (one row without --compare)')
    parser.add_argument("pretrain_args", nargs=argparse.REMAINDER,
                        help="-- then scripts/pretrain_gpt.py's arguments")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    rest = ns.pretrain_args[1:] if ns.pretrain_args[:1] == ["--"] else ns.pretrain_args
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Megatron's import warns about every GPU library it lacks
            checked = check(parse(rest, ns.world_size))
            if ns.compare:
                lines, rows, best = comparison(checked, ns.gpus_per_node, ns.op_costs, ns.gpu_memory)
            else:
                lines, one = plan(checked, ns.gpus_per_node, ns.op_costs)
                rows, best = [one], None
    except Refused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    except ScheduleError as exc:  # the pretraining arguments do not parse
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    if ns.json:
        _write_json(ns.json, rows, best)
    return 0

