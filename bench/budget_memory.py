"""The activation budget measured on CPU (issue 26): DualPipeV's peak activation bytes per rank
under ``--dualpipe-max-activations K`` against what the simulator plans, with step times and
the losses against Megatron's 1F1B.

One launch per pipeline size P (importing Megatron costs seconds per process) builds the
bench's dense Megatron GPT (bench_megatron.py's model, M micro-batches) as Megatron's 1F1B,
DualPipeV in DeepSeek's order, and DualPipeV under each budget: K = DeepSeek's peak, ceil(3/4)
and ceil(1/2) of it, and the minimum (``optimize.min_activations``), each clamped up to the
minimum, repeats dropped. Budgeted orders are optimized for the FLOP model's stage costs of the
even split (what ``--dualpipe-layout auto`` uses; the same on every rank). Every variant runs
warm-up rounds, timed rounds (each variant once per round, the order reversed every other
round) and one traced step under the activation meter (activation_meter.py, the meter of
bench_megatron.py) with its timeline, which gives every executed op its bytes (op_bytes.py).

Per budget: the planned peak (live (d,s,m) per rank, the simulator's unit, of the order the
ranks executed, read back from their traces), planned bytes (units x one stage activation: the
median bytes a decoder-only stage's F saves), the measured peak bytes per rank and the ratio,
the same units weighed by each stage's own F bytes, and with B(w=false)'s release as well, and
the op during which each rank peaked (what rose inside it is the rest of the gap); the
simulated step (FLOP costs) and the measured step, each against DeepSeek's order; the losses
against 1F1B's (per micro-batch, relative difference at most 1e-6, the tolerance of
tests/megatron_dualpipe_workers.py; whether bitwise equal is reported) and the gradients' total
squared norm. Exits non-zero when a loss differs.

Prints markdown tables and writes ``bench/results/budget_memory.json``.

Run: ``.venv/bin/python bench/budget_memory.py [--ranks 2 4] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench_megatron import machine, quiet_megatron_imports, start_worker  # bench/ modules: this script's directory is on sys.path
from megatron_gpt import DENSE, GPTShape, flop_costs, megatron_variant, our_variant
from op_bytes import OpBytes, per_op, stage_bytes, weighted_peak
from ports import free_port
from schedule_report import spread

from dualpipe_megatron.schedules import build_schedule, simulate
from dualpipe_megatron.schedules.cli import markdown_table
from dualpipe_megatron.schedules.events import peak_live_activations
from dualpipe_megatron.schedules.layout import even_counts, layout_string, stage_costs_for
from dualpipe_megatron.schedules.optimize import min_activations
from dualpipe_megatron.schedules.simulate import StageCosts
from dualpipe_megatron.trace import load, pipelines
from dualpipe_megatron.trace.recorder import trace_path
from dualpipe_megatron.trace.records import read_rank, step_schedule

RESULTS = Path(__file__).resolve().parent / "results" / "budget_memory.json"
SCHEDULE = "dualpipev"
REFERENCE = "1f1b"
TOLERANCE = 1e-6  # each loss relative to 1F1B's (tests/megatron_dualpipe_workers.py's tolerance)


@dataclass(frozen=True)
class BudgetConfig:
    """One launch: pipeline size, model, micro-batches, budgets (None: DeepSeek's order) and rounds."""

    pp: int
    shape: GPTShape
    microbatches: int
    budgets: tuple[tuple[int | None, str], ...]  # (K, what it is)
    warmup: int
    repeats: int


def variant_name(budget: int | None) -> str:
    return SCHEDULE if budget is None else f"{SCHEDULE}-k{budget}"


def budgets(pp: int, microbatches: int) -> tuple[tuple[int | None, str], ...]:
    """(K, what it is): None, then DeepSeek's peak, ceil(3/4), ceil(1/2) of it and the minimum,
    clamped up to the minimum, each K once."""
    sched = build_schedule(SCHEDULE, pp, microbatches)
    top, least = max(peak_live_activations(ops) for ops in sched.ops), min_activations(sched)
    out: dict[int | None, str] = {None: "none"}
    for k, what in ((top, "DeepSeek's peak"), (-(-3 * top // 4), "⌈¾ peak⌉"), (-(-top // 2), "⌈½ peak⌉"),
                    (least, "minimum")):
        k = max(least, k)
        out[k] = f"{out[k]} = {what}" if k in out else what
    return tuple(out.items())


def flop_stage_costs(shape: GPTShape, pp: int, microbatches: int) -> StageCosts:
    """The FLOP model's stage costs of DualPipeV's even split (what the budgeted orders are optimized for)."""
    return stage_costs_for(build_schedule(SCHEDULE, pp, microbatches), flop_costs(shape),
                           even_counts(shape.layers, 2 * pp))


def _grad_square(params: list) -> float:
    return sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None)


def _worker(rank: int, config: BudgetConfig, port: int, out_dir: str, traces: Path) -> None:
    start_worker(rank, config.pp, port)
    shape, pp, m = config.shape, config.pp, config.microbatches
    costs = flop_stage_costs(shape, pp, m)
    variants = [megatron_variant(REFERENCE, shape, pp, 1, m, None)]
    dist.barrier()
    for k, _ in config.budgets:
        variants.append(our_variant(SCHEDULE, shape, pp, 1, m, traces, variant_name(k),
                                    optimize_for=None if k is None else costs, max_activations=k))
        dist.barrier()
    for _ in range(config.warmup):
        for v in variants:
            v.warm_up()
    for r in range(config.repeats):
        for v in variants if r % 2 == 0 else variants[::-1]:
            v.timed_step()
    mine: dict[str, dict[str, Any]] = {}
    for v in variants:
        meter = v.memory_step(timeline=True)
        reports = v.last_output or []
        mine[v.name] = {"seconds": v.seconds, "peak": meter.peak, "grad_square": _grad_square(v.params),
                        "losses": [float(r["lm loss"]) for r in reports]}
        if v.trace_dir is not None:  # ours: the metered step is the trace's last
            mine[v.name]["ops"] = per_op(meter.timeline, read_rank(trace_path(v.trace_dir, rank)).steps[-1].ops)
    gathered: list = [None] * pp
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(os.path.join(out_dir, "ranks.pkl"), "wb") as f:
            pickle.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def _peak_op(ops: list[OpBytes]) -> dict[str, Any]:
    """The op during which a rank's meter peaked, and how far that peak rose above both its ends."""
    top = max(ops, key=lambda o: o.top)
    return {"op": str(top.op), "above_its_ends": top.top - max(top.before, top.after)}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def analyse(config: BudgetConfig, ranks: list[dict[str, Any]], traces: Path) -> dict[str, Any]:
    """Planned against measured, per budget, from every rank's gathered figures and traces."""
    names = [variant_name(k) for k, _ in config.budgets]
    stages = stage_bytes(o for name in names for r in ranks for o in r[name]["ops"])
    last = 2 * config.pp - 1
    unit = round(median(sb.forward for (_, s), sb in stages.items() if 0 < s < last))
    costs = flop_stage_costs(config.shape, config.pp, config.microbatches)
    ref = ranks[-1][REFERENCE]
    ref_losses, ref_grad = ref["losses"], sum(r[REFERENCE]["grad_square"] for r in ranks)
    if not ref_losses:
        raise RuntimeError(f"P={config.pp}: Megatron 1F1B reported no losses on the last pipeline rank")
    seconds = {name: ranks[0][name]["seconds"] for name in [REFERENCE, *names]}
    rows: list[dict[str, Any]] = [{"name": REFERENCE, "budget": None,
                                   "measured_bytes": [r[REFERENCE]["peak"] for r in ranks],
                                   "step_ms": spread([s * 1e3 for s in seconds[REFERENCE]])}]
    deepseek_step = None
    for (k, what), name in zip(config.budgets, names):
        sched = step_schedule(pipelines(load(traces / name))[0], -1)
        step = simulate(sched, costs).makespan
        deepseek_step = deepseek_step or step
        losses = ranks[-1][name]["losses"]
        grad = sum(r[name]["grad_square"] for r in ranks)
        measured = [r[name]["peak"] for r in ranks]
        units = [peak_live_activations(ops) for ops in sched.ops]
        rows.append({
            "name": name, "budget": k, "budget_is": what, "order": [[str(op) for op in ops] for ops in sched.ops],
            "planned_units": units, "planned_bytes": [u * unit for u in units], "measured_bytes": measured,
            "measured_over_planned": max(measured) / (max(units) * unit),
            "stage_weighted_bytes": [weighted_peak(ops, stages, False) for ops in sched.ops],
            "with_input_grad_release_bytes": [weighted_peak(ops, stages, True) for ops in sched.ops],
            "peak_op": [_peak_op(r[name]["ops"]) for r in ranks],
            "simulated_step_flops": float(step), "simulated_over_deepseek": float(step / deepseek_step),
            "step_ms": spread([s * 1e3 for s in seconds[name]]),
            "step_over_deepseek": spread([a / b for a, b in zip(seconds[name], seconds[SCHEDULE])]),
            "losses_bitwise_equal_1f1b": losses == ref_losses,
            "loss_max_rel_diff": max((_rel(a, b) for a, b in zip(ref_losses, losses)), default=0.0)
            if len(losses) == len(ref_losses) else float("inf"),
            "grad_square_rel_diff": _rel(ref_grad, grad),
        })
    ours = [row for row in rows if row["name"] != REFERENCE]
    falling = all(max(a["measured_bytes"]) >= max(b["measured_bytes"]) for a, b in zip(ours[1:], ours[2:]))
    holds = layout_string(even_counts(config.shape.layers, 2 * config.pp)).split("|")
    return {"pp": config.pp, "microbatches": config.microbatches, "shape": asdict(config.shape),
            "warmup": config.warmup, "repeats": config.repeats, "stage_activation_bytes": unit,
            "stages": [{"stage": s, "holds": holds[s], **sb.to_json_obj()} for (_, s), sb in stages.items()],
            "losses": len(ref_losses), "measured_peak_falls_with_budget": falling, "rows": rows}


def measure(config: BudgetConfig) -> dict[str, Any]:
    port = free_port()
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out_dir:
        traces = Path(out_dir) / "traces"
        mp.start_processes(_worker, args=(config, port, out_dir, traces), nprocs=config.pp, start_method="spawn")
        with open(os.path.join(out_dir, "ranks.pkl"), "rb") as f:
            ranks = pickle.load(f)
        result = analyse(config, ranks, traces)
    return {**result, "wall_s": time.perf_counter() - start, "load_1min": [load_before, os.getloadavg()[0]]}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _spread_text(s: dict[str, float], digits: int) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _table_row(pp: int, row: dict[str, Any]) -> list[str]:
    step = _spread_text(row["step_ms"], 0)
    if row["name"] == REFERENCE:
        return [str(pp), "Megatron 1F1B", "–", "–", "–", _mib(max(row["measured_bytes"])), "–", "–", "–", "–",
                step, "–", "reference"]
    k = row["budget_is"] if row["budget"] is None else f"{row['budget']} ({row['budget_is']})"
    loss = "bitwise" if row["losses_bitwise_equal_1f1b"] else f"rel {row['loss_max_rel_diff']:.1g}"
    return [str(pp), "DeepSeek's" if row["budget"] is None else "optimized", k, str(max(row["planned_units"])),
            _mib(max(row["planned_bytes"])), _mib(max(row["measured_bytes"])), f"{row['measured_over_planned']:.2f}",
            _mib(max(row["stage_weighted_bytes"])), _mib(max(row["with_input_grad_release_bytes"])),
            f"{row['simulated_over_deepseek']:.3f}", step, _spread_text(row["step_over_deepseek"], 2),
            f"{loss}; grads² rel {row['grad_square_rel_diff']:.1g}"]


def markdown(results: list[dict[str, Any]]) -> str:
    """The budget table (largest rank of each figure), then each P's per-stage bytes."""
    rows = [_table_row(res["pp"], row) for res in results for row in res["rows"]]
    stage_rows = [[str(res["pp"]), str(st["stage"]), f"`{st['holds']}`", _mib(st["forward"]),
                   _mib(st["kept_after_input_grad"]), f"{st['kept_after_input_grad'] / st['forward']:.2f}"]
                  for res in results for st in res["stages"]]
    text = markdown_table(
        ["P", "order", "K", "planned peak (units)", "planned MiB (units × stage activation)",
         "measured peak MiB/rank", "measured ÷ planned", "planned, stages weighed (MiB)",
         "+ B(w=false) release (MiB)", "simulated step ÷ DeepSeek's", "step ms: median (min–max)",
         "step ÷ DeepSeek's order, pair by pair", "vs Megatron 1F1B: losses; grads²"], rows)
    return text + "\n\n" + markdown_table(
        ["P", "stage", "holds", "F saves (MiB)", "kept after B(w=false) until W (MiB)", "kept ÷ F"], stage_rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="pipeline sizes, one launch each")
    parser.add_argument("--microbatches", type=int, default=8, help="M (bench_megatron.py's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (each runs every variant once)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (the first builds the orders)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 1:
        parser.error("--repeats and --warmup must be at least 1")
    from dualpipe_megatron.megatron.model import check_configuration

    quiet_megatron_imports()
    configs = []
    for pp in args.ranks:
        try:
            check_configuration(SCHEDULE, pp, args.microbatches, DENSE.layers)
        except ValueError as exc:
            parser.error(f"P={pp}: {exc}")
        configs.append(BudgetConfig(pp, DENSE, args.microbatches, budgets(pp, args.microbatches),
                                    args.warmup, args.repeats))
    results = []
    for config in configs:
        print(f"P={config.pp}: {config.pp} processes, budgets {[k for k, _ in config.budgets]} + Megatron 1F1B, "
              f"{config.warmup} + {config.repeats} rounds ...", flush=True)
        results.append(measure(config))
        print(f"P={config.pp}: done in {results[-1]['wall_s']:.0f} s; 1-minute load average "
              f"{results[-1]['load_1min'][0]:.1f} before, {results[-1]['load_1min'][1]:.1f} after", flush=True)
    table = markdown(results)
    print("\n" + table)
    meta = {"what": "DualPipeV under --dualpipe-max-activations K, CPU/gloo, one forward_backward_func call "
                    "per step fenced by barriers, no optimizer", "date": datetime.date.today().isoformat(),
            "machine": machine(), "python": platform.python_version(), "torch": torch.__version__,
            "megatron_core": version("megatron-core"), "threads_per_process": 1,
            "loss_tolerance": TOLERANCE}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"meta": meta, "table": table, "configs": results}, indent=1) + "\n")
    print(f"\nwrote {args.output}")
    bad = [f"P={res['pp']} {row['name']}: loss rel diff {row['loss_max_rel_diff']:.3g}"
           for res in results for row in res["rows"] if row.get("loss_max_rel_diff", 0.0) > TOLERANCE]
    if bad:
        raise SystemExit("losses differ from Megatron 1F1B's: " + "; ".join(bad))


if __name__ == "__main__":
    main()
