"""``python -m dualpipe_megatron.runtime``: check p2p calls against the model of NCCL's semantics.

- ``nccl-check FILE``: a step's recorded calls (``DUALPIPE_NCCL_STRICT_DIR`` writes them
  when strict mode fails a step), a schedule ``dump`` with its lowered programs, or any
  ``{"programs": {rank: [events]}}`` file.
- ``nccl-sweep``: the runtime's real posting logic for generated schedules (no processes).
- ``nccl-controls``: the model's control cases and their verdicts.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

from ..schedules import GENERATORS, ScheduleError
from ..schedules.cli import run_command
from .dry_run import check_case, record, sweep_cases
from .nccl_model import check, load_programs


def _controls() -> dict[str, dict[int, list[dict]]]:
    """Two ranks exchanging one message each way, posted three ways."""
    def unbatched(first: str, second: str, peer: int) -> list[dict]:
        return [{"post": first, "group": "g", "peer": peer, "id": 0, "what": first},
                {"post": second, "group": "g", "peer": peer, "id": 1, "what": second},
                {"wait": [0, 1], "what": "both"}]

    def batched(peer: int) -> list[dict]:
        ops = [{"kind": "send", "peer": peer}, {"kind": "recv", "peer": peer}]
        return [{"post": "batch", "group": "g", "id": 0, "ops": ops, "what": "[send, recv]"},
                {"wait": [0], "what": "the batch"}]

    return {
        "isend then irecv, unbatched, on both ranks (expected: deadlock)":
            {0: unbatched("send", "recv", 1), 1: unbatched("send", "recv", 0)},
        "one batch_isend_irecv([send, recv]) on both ranks (expected: deadlock-free)":
            {0: batched(1), 1: batched(0)},
        "Megatron's parity order: even send then recv, odd recv then send (expected: deadlock-free)":
            {0: unbatched("send", "recv", 1), 1: unbatched("recv", "send", 0)},
    }


def _cmd_controls(args: argparse.Namespace) -> None:
    for name, programs in _controls().items():
        print(f"{name}\n  {check(programs, warm={('g', 0, 1)}).summary}")


def _cmd_check(args: argparse.Namespace) -> None:
    try:
        with open(args.file) as f:
            obj = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {args.file}: {exc}") from None
    warm = {tuple(w) for w in obj.get("warm", [])} if isinstance(obj, dict) else set()
    verdict = check(load_programs(obj), unbatched=args.queues, warm=warm)
    print(verdict.report())
    if not verdict.ok:
        raise SystemExit(1)


def _cmd_sweep(args: argparse.Namespace) -> None:
    began, failed, count = time.monotonic(), [], 0
    for case in sweep_cases(args.schedules, args.ranks):
        if args.microbatches and case.microbatches not in args.microbatches:
            continue
        count += 1
        verdicts = check_case(case)
        if verdicts:
            failed.append(case)
            print(f"FAIL {case}: {verdicts[0].summary}")
        elif args.verbose:
            print(f"ok   {case}")
    print(f"{count} cases, {len(failed)} failed, {time.monotonic() - began:.1f} s")
    if args.dump and failed:
        with open(args.dump, "w") as f:
            json.dump({"programs": record(failed[0])}, f)
        print(f"calls of the first failure ({failed[0]}) written to {args.dump}")
    if failed:
        raise SystemExit(1)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dualpipe_megatron.runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("nccl-check", help="check recorded calls (JSON) under the NCCL model")
    p.add_argument("file")
    p.add_argument("--queues", choices=("pair", "group"), default="pair",
                   help="unbatched p2p: one queue per rank pair (torch default) or per group (device_id init)")
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("nccl-sweep", help="check the runtime's posting logic over generated schedules")
    p.add_argument("--schedules", nargs="+", choices=sorted(GENERATORS), default=sorted(GENERATORS))
    p.add_argument("--ranks", nargs="+", type=int, default=list(range(2, 17)))
    p.add_argument("--microbatches", nargs="*", type=int, default=[],
                   help="only these M (default: 2P, 2P+1 or 2P+2, 4P)")
    p.add_argument("--dump", help="write the calls of the first failing case to this JSON file")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=_cmd_sweep)
    p = sub.add_parser("nccl-controls", help="print the model's control cases and verdicts")
    p.set_defaults(func=_cmd_controls)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(make_parser(), argv, (ScheduleError, ValueError))


__all__ = ["main", "make_parser"]
