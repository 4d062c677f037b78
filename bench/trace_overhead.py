"""What ``--dualpipe-trace`` adds to a training step: the demo's job with and without it.

Three measurements of the ``make demo`` training job (4 CPU processes, MoE, DualPipeV):

1. whole runs in interleaved pairs, traced and untraced, alternating which goes
   first; median Megatron iteration time after warm-up;
2. one run tracing every other iteration (``trace_alternating_entry.py``): each
   traced iteration against the mean of its two untraced neighbours, which
   cancels machine-load drift that (1) is exposed to on a shared machine;
3. the recorder alone (per op, per step written): the deterministic cost.

Prints the figures and writes ``bench/results/trace_overhead.json``.

Run: ``.venv/bin/python bench/trace_overhead.py [--pairs 3] [--iterations 30] [--alternating 60]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from statistics import median

from dualpipe_megatron.demo import PRETRAIN, parse_iterations, pretrain_command, run_logged
from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.ir import halves
from dualpipe_megatron.trace import OpTracer

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "trace_overhead.json"
ALTERNATING = BENCH / "trace_alternating_entry.py"


def run_ms(iterations: int, warmup: int, traced: bool, work: Path, name: str, alternating: bool = False) -> list[float]:
    """Iteration times (ms) after ``warmup`` of one training job."""
    log = work / f"{name}.log"
    cmd = pretrain_command(iterations, work / name if traced else None)
    if alternating:
        cmd[cmd.index(str(PRETRAIN))] = str(ALTERNATING)
    code = run_logged(cmd, log, echo=False)
    its = parse_iterations(log.read_text(errors="replace"))
    if code != 0 or len(its) != iterations:
        raise SystemExit(f"{name}: training failed (exit code {code}); see {log}")
    return [it.ms for it in its[warmup:]]


def alternating_overhead(iterations: int, warmup: int, work: Path) -> dict[str, float]:
    """One run tracing odd iterations: each traced one against its untraced neighbours' mean."""
    start = warmup + (warmup % 2 == 1)  # the first kept iteration is an odd (traced) one
    times = run_ms(iterations, start, True, work, "alternating", alternating=True)  # times[0] is traced
    ratios = [times[i] / ((times[i - 1] + times[i + 1]) / 2) - 1 for i in range(2, len(times) - 1, 2)]
    return {"pairs": len(ratios), "median_overhead_pct": 100 * median(ratios),
            "traced_median_ms": median(times[0::2]), "untraced_median_ms": median(times[1::2])}


def recorder_cost(work: Path, ranks: int = 2, microbatches: int = 8, steps: int = 200) -> dict[str, float]:
    """µs the recorder spends per op (clock reads + append) and per step (encode + write)."""
    sched = build_schedule("dualpipev", ranks, microbatches)
    ops = [(i, halves(op)) for i, op in enumerate(sched.ops[0])]
    tracer = OpTracer(work / "micro", 0, list(range(ranks)))
    op_time = step_time = 0
    for _ in range(steps):
        tracer.step_begun(sched, False)
        begin = time.perf_counter_ns()
        for index, parts in ops:
            t0 = time.perf_counter_ns()
            tracer.op_done(index, parts, t0, time.perf_counter_ns(), 0)
        mid = time.perf_counter_ns()
        tracer.step_done()
        op_time += mid - begin
        step_time += time.perf_counter_ns() - mid
    tracer.close()
    return {"ops_per_step": len(ops), "us_per_op": op_time / steps / len(ops) / 1000,
            "us_per_step_written": step_time / steps / 1000}


def whole_runs(pairs: int, iterations: int, warmup: int, work: Path) -> dict[str, object]:
    """Interleaved traced/untraced runs, alternating which of a pair goes first."""
    times: dict[str, list[float]] = {"traced": [], "untraced": []}
    pair_pct = []
    for pair in range(pairs):
        order = ("traced", "untraced") if pair % 2 == 0 else ("untraced", "traced")
        run = {kind: run_ms(iterations, warmup, kind == "traced", work, f"{kind}{pair}") for kind in order}
        for kind in order:
            times[kind] += run[kind]
        pair_pct.append(100 * (median(run["traced"]) / median(run["untraced"]) - 1))
        print(f"pair {pair} ({order[0]} first): traced {median(run['traced']):.1f} ms, untraced "
              f"{median(run['untraced']):.1f} ms per iteration ({pair_pct[-1]:+.1f}%)", flush=True)
    traced, untraced = median(times["traced"]), median(times["untraced"])
    print(f"whole runs: median iteration traced {traced:.1f} ms, untraced {untraced:.1f} ms -> "
          f"{100 * (traced / untraced - 1):+.2f}%", flush=True)
    return {"pairs": pairs, "median_ms": {"traced": traced, "untraced": untraced},
            "overhead_pct": 100 * (traced / untraced - 1), "pair_overhead_pct": pair_pct}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="traced/untraced run pairs (0: skip them)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out of each run")
    parser.add_argument("--alternating", type=int, default=60,
                        help="iterations of the every-other-step run (0: skip it)")
    args = parser.parse_args()
    result: dict[str, object] = {
        "config": "make demo's job: 4 CPU processes, MoE EP=2 x DualPipeV P=2 x DP=2, M=8",
        "host": platform.node(), "iterations": args.iterations, "warmup": args.warmup,
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.pairs:
            result["whole_runs"] = whole_runs(args.pairs, args.iterations, args.warmup, work)
        if args.alternating:
            alt = result["alternating"] = alternating_overhead(args.alternating, args.warmup, work)
            print(f"every other iteration traced: {alt['pairs']} traced iterations against their untraced "
                  f"neighbours, median {alt['median_overhead_pct']:+.2f}% (medians: traced "
                  f"{alt['traced_median_ms']:.1f} ms, untraced {alt['untraced_median_ms']:.1f} ms)")
        micro = result["recorder"] = recorder_cost(work)
    print(f"recorder itself: {micro['us_per_op']:.2f} µs per op, {micro['us_per_step_written']:.0f} µs per "
          f"step written ({micro['ops_per_step']} ops per step of the demo's pipeline rank 0)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
