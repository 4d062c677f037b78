"""``python -m dualpipe_megatron.demo``: a small MoE GPT trained with DualPipeV on 4 CPU processes.

It runs ``scripts/pretrain_gpt.py`` under torchrun (8 layers, 4 experts top-2,
all-to-all dispatcher, expert parallel 2 x pipeline 2 x data parallel 2, mock
data, gloo) with ``--dualpipe-trace`` twice: a short run measures the stage costs
(``trace costs``), then the demo's run trains with ``--dualpipe-layout auto`` and
the op order optimized for those costs (``--dualpipe-optimize-order
--dualpipe-stage-costs``). It prints the loss, the throughput, the measured bubble
next to the simulator's prediction from the measured op costs, and how well the
run's own stage costs predict its step; it writes to ``outputs/demo/``:
``calibration/`` (the short run), ``stage_costs.json``, ``train.log``, ``trace/``
(per-rank files), ``trace.json`` (Chrome/Perfetto) and ``timeline.png``.
``--deepseek-order`` skips the short run and trains in DeepSeek's order.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Sequence

from .megatron.cpu_compat import CPU_FLAGS
from .schedules.optimize import optimize_order
from .schedules.simulate import simulate
from .trace import analyze, load, pipelines, write_chrome_trace
from .trace.analysis import stage_cost_fit
from .trace.figure import draw_measured
from .trace.report import format_report

REPO = Path(__file__).resolve().parent.parent
PRETRAIN = REPO / "scripts" / "pretrain_gpt.py"
PROCESSES = 4
SEQ_LENGTH, GLOBAL_BATCH = 64, 16
WARMUP = 2  # iterations left out of throughput and bubble figures (first-step allocation, caches)
CALIBRATION_ITERATIONS = 6  # the short run whose steps after WARMUP give the stage costs

MODEL = (f"--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length {SEQ_LENGTH} "
         f"--max-position-embeddings {SEQ_LENGTH} --vocab-size 256 "
         "--position-embedding-type learned_absolute --hidden-dropout 0 --attention-dropout 0 "
         # MoE; Megatron 0.19.2's expert bias hits an in-place-on-view error, hence no linear biases.
         "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
         "--disable-bias-linear").split()
PARALLEL = ("--pipeline-model-parallel-size 2 --pipeline-schedule dualpipev "
            "--expert-model-parallel-size 2").split()
# Micro-batch 1 x data parallel 2: 8 micro-batches per pipeline per step (M = 4P).
DATA = (f"--mock-data --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size {GLOBAL_BATCH} "
        "--seed 1234 --log-interval 1 --eval-interval 1000 --eval-iters 0").split()
TRAIN = "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2".split()

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)"
                       r".*?lm loss: ([0-9.E+-]+)")


@dataclass(frozen=True)
class Iteration:
    number: int
    ms: float
    loss: float


def pretrain_command(iterations: int, trace_dir: Path | None, extra: Sequence[str] = ()) -> list[str]:
    """The torchrun command line of the demo's training job."""
    torchrun = Path(sys.executable).with_name("torchrun")
    trace = ["--dualpipe-trace", str(trace_dir)] if trace_dir is not None else []
    return [str(torchrun), "--standalone", f"--nproc-per-node={PROCESSES}", str(PRETRAIN),
            *MODEL, *PARALLEL, *CPU_FLAGS, *DATA, *TRAIN, "--train-iters", str(iterations), *trace, *extra]


def parse_iterations(log: str) -> list[Iteration]:
    """Megatron's per-iteration log lines (``--log-interval 1``)."""
    return [Iteration(int(n), float(ms), float(loss)) for n, ms, loss in ITERATION.findall(log)]


def run_logged(cmd: Sequence[str], log_path: Path, echo: bool) -> int:
    """Run ``cmd`` with its output in ``log_path``; with ``echo``, one short line per iteration."""
    # A mock corpus of 256 documents: enough samples, and start-up without indexing 200M tokens.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DUALPIPE_MOCK_DOCUMENTS": "256"}
    with log_path.open("w") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                     text=True, env=env, cwd=REPO) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if echo:
                for it in parse_iterations(line):
                    print(f"  iteration {it.number:3d}  lm loss {it.loss:.4f}  {it.ms:7.1f} ms", flush=True)
    return proc.returncode


def tokens_per_second(iterations: Sequence[Iteration]) -> float:
    """Whole-job training throughput at the median iteration time after warm-up."""
    steady = iterations[WARMUP:] or iterations
    return GLOBAL_BATCH * SEQ_LENGTH / (median(it.ms for it in steady) / 1000)


def report_trace(trace_dir: Path, out: Path) -> None:
    """Merge, analyse and draw the demo's trace; print the bubble tables and the stage-cost fit."""
    traces = load(trace_dir)
    events = write_chrome_trace(traces, out / "trace.json")
    reports = analyze(traces, skip=WARMUP)
    print("\nMeasured bubble (median over steps) against the simulator's prediction from the measured "
          "op costs:")
    for report in reports:
        print(format_report(report))
    fit = stage_cost_fit(pipelines(traces)[0], WARMUP)
    print(f"\nThis run's stage costs (trace costs, pipeline 0) simulate a {fit.predicted_ms:.1f} ms step "
          f"against the {fit.measured_ms:.1f} ms measured ({100 * fit.error:+.1f}%)")
    step = draw_measured(pipelines(traces)[0], reports[0], out / "timeline.png")
    print(f"\nwrote {out / 'trace.json'} ({events} events, {len(traces)} tracks; open in ui.perfetto.dev), "
          f"{out / 'timeline.png'} (pipeline 0, step {step}), {out / 'train.log'}")


def calibrate(out: Path, layout: Sequence[str]) -> list[str] | None:
    """The short traced run: its measured stage costs into ``out/stage_costs.json``; returns the
    flags that train in the order optimized for them (None if the run failed)."""
    run_dir = out / "calibration"
    run_dir.mkdir()
    print(f"Measuring stage costs: {CALIBRATION_ITERATIONS} iterations, traced; log: {run_dir / 'train.log'}",
          flush=True)
    cmd = pretrain_command(CALIBRATION_ITERATIONS, run_dir / "trace", layout)
    if run_logged(cmd, run_dir / "train.log", echo=False) != 0:
        tail = (run_dir / "train.log").read_text(errors="replace").splitlines()[-40:]
        print("\n".join(tail) + f"\ncalibration run failed: {' '.join(cmd)}", file=sys.stderr)
        return None
    fit = stage_cost_fit(pipelines(load(run_dir / "trace"))[0], WARMUP)
    path = out / "stage_costs.json"
    path.write_text(json.dumps(fit.costs.to_json_obj(), indent=1) + "\n")
    busy = [sum(float(c.F + c.B) for (d, s), c in fit.costs.stages.items() if fit.schedule.rank_of(d, s) == r)
            for r in range(fit.schedule.ranks)]
    optimized = simulate(optimize_order(fit.schedule, fit.costs), fit.costs).makespan
    print(f"wrote {path}: F + B per micro-batch {', '.join(f'{b:.1f}' for b in busy)} ms on pipeline ranks "
          f"{', '.join(map(str, range(len(busy))))}; simulated step {fit.predicted_ms:.1f} ms in DeepSeek's "
          f"order, {float(optimized):.1f} ms optimized", flush=True)
    return [*layout, "--dualpipe-optimize-order", "--dualpipe-stage-costs", str(path)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dualpipe_megatron.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "demo")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--no-trace", action="store_true", help="train without --dualpipe-trace (and in "
                        "DeepSeek's order: there is nothing to measure stage costs with)")
    parser.add_argument("--deepseek-order", action="store_true",
                        help="skip the stage-cost run: even layout, DeepSeek's op order")
    args = parser.parse_args(argv)

    shutil.rmtree(args.out, ignore_errors=True)  # a trace directory must hold one run only
    args.out.mkdir(parents=True)
    trace_dir = None if args.no_trace else args.out / "trace"
    tuned: list[str] = []
    if not (args.no_trace or args.deepseek_order):
        flags = calibrate(args.out, ["--dualpipe-layout", "auto"])
        if flags is None:
            return 1
        tuned = flags
    cmd = pretrain_command(args.iterations, trace_dir, tuned)
    order = "the op order optimized for them" if tuned else "DeepSeek's op order"
    print(f"Training an 8-layer MoE GPT (4 experts, top-2, EP=2) with DualPipeV (P=2, DP=2) on {PROCESSES} "
          f"CPU processes, {args.iterations} iterations, {order}; log: {args.out / 'train.log'}", flush=True)
    code = run_logged(cmd, args.out / "train.log", echo=True)
    log = (args.out / "train.log").read_text(errors="replace")
    iterations = parse_iterations(log)
    if code != 0 or not iterations:
        print("\n".join(log.splitlines()[-40:]) + f"\ntraining failed (exit code {code}): {' '.join(cmd)}",
              file=sys.stderr)
        return 1
    for line in log.splitlines():
        if line.startswith(("dualpipe: --dualpipe-layout auto chose", "DualPipe op order optimized")):
            print(line)
    first, last = iterations[0], iterations[-1]
    print(f"\nlm loss {first.loss:.4f} (iteration {first.number}) -> {last.loss:.4f} (iteration {last.number}); "
          f"{tokens_per_second(iterations):.0f} tokens/s (whole job, median iteration after {WARMUP})")
    if trace_dir is not None:
        report_trace(trace_dir, args.out)
    if last.loss >= first.loss:
        print("error: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
