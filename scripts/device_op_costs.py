"""The one prepared device check: H200 op costs of a DeepSeek-V3-shaped chunk, then the projection.

Single process, one GPU, no launcher and no Megatron (a bare device image has
torch only). It measures F, B, B(w=false), W and F-then-B of the ``h200``
preset (a full-width EP rank's share of two DeepSeek-V3 MoE layers, bf16),
projects the DeepSeek-V3-like job with those costs, and writes under ``$OUT``
(default ``outputs/device``):

    op_costs.json     the measured costs (``measure``'s format)
    projection.md     the printed table, inputs and assumptions
    projection.json   the same figures as JSON

    python3 scripts/device_op_costs.py              # on the GPU machine, ~1 minute
    python scripts/device_op_costs.py --dry-run     # CPU, tiny shape, seconds: checks the path
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs from a bare checkout

from dualpipe_megatron.projection.cli import main as projection  # noqa: E402


def run(argv: list[str]) -> str:
    """One projection CLI call; its output is printed and returned. Exits on its error."""
    print("$ python -m dualpipe_megatron.projection " + " ".join(argv), flush=True)
    started = time.perf_counter()
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = projection(argv)
    print(buffer.getvalue(), end="")
    print(f"({time.perf_counter() - started:.1f} s)", flush=True)
    if status:
        raise SystemExit(status)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny shape, one round: checks the script, measures nothing real")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or "outputs/device")
    out.mkdir(parents=True, exist_ok=True)
    costs = out / "op_costs.json"
    if args.dry_run:
        measure = ["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0"]
    else:
        measure = ["--preset", "h200", "--device", "cuda", "--dtype", "bfloat16",
                   "--repeats", str(args.repeats), "--warmup", "3"]
    run(["measure", *measure, "-o", str(costs)])
    table = run(["project", "--op-costs", str(costs), "--json", str(out / "projection.json")])
    (out / "projection.md").write_text(table)
    print(f"wrote {costs}, {out / 'projection.md'}, {out / 'projection.json'}")


if __name__ == "__main__":
    main()
