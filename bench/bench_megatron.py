"""Megatron's 1F1B and interleaved schedules against our DualPipeV and DualPipe (CPU, gloo).

Interleaved runs with two virtual stages per rank, and with four where the layers split into
``4 * P`` whole stages (8 layers: at P=2).

One launch of ``world`` processes per configuration builds every schedule's model once
(importing Megatron costs seconds per process) and then runs the schedules in rounds,
each schedule once per round, the order reversed every other round (A B C C B A ...), so
drifts in machine load hit all alike. Each timed step is one ``forward_backward_func``
call fenced by barriers (no optimizer). Per schedule: step time, tokens/s, the ratio to
Megatron's 1F1B round by round, the measured bubble (share of the fenced step a rank was
not computing, averaged over ranks; see busy_time.py), CPU seconds of all ranks, peak
activation bytes and parameter bytes per rank. Dense configurations also run torch's
``ScheduleDualPipeV`` and our native ``Pipeline`` on a plain-module GPT of the same shapes.

``dualpipev-tuned`` closes the loop of issue 16: after the warm-up rounds (and a few more
steps of plain ``dualpipev``, traced), every rank reads the stage costs those traces measured
(``python -m dualpipe_megatron.trace costs``), builds DualPipeV with ``--dualpipe-layout auto``'s
split and the op order optimized for those costs (``--dualpipe-optimize-order
--dualpipe-stage-costs``), warms it up and times it in the same rounds. Megatron's 1F1B could
count the embedding and the loss as layers in its split; the results say what Megatron makes
of that for each configuration (at P=2 its own split, at P=4 with 8 layers a refusal).

Prints a markdown table and writes ``bench/results/megatron_schedules.json``.

Run: ``.venv/bin/python bench/bench_megatron.py [--configs dense-p2 dense-p4 moe-p2-ep2] [--repeats 12]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import pickle
import platform
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megatron_gpt  # bench/ modules: this script's directory is on sys.path
import plain_gpt
from busy_time import ComputeClock, time_megatron_compute
from megatron_gpt import DENSE, OUR_SCHEDULES, TUNED, GPTShape, megatron_schedules
from ports import free_port
from schedule_report import markdown, summarize

RESULTS = Path(__file__).resolve().parent / "results" / "megatron_schedules.json"
CONFIGS = ("dense-p2", "dense-p4", "moe-p2-ep2")
CALIBRATION_STEPS = 3  # plain dualpipev steps traced after warm-up for the tuned variant's stage costs


@dataclass(frozen=True)
class BenchConfig:
    """One process-group launch: pipeline size, expert parallelism, model and batch."""

    name: str
    pp: int
    ep: int
    shape: GPTShape
    microbatches: int
    plain: bool  # also torch's ScheduleDualPipeV vs our Pipeline on plain modules (world == pp only)
    warmup: int
    repeats: int

    @property
    def world(self) -> int:
        return self.pp * self.ep  # data-parallel size ep: experts are sharded across the DP ranks

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.shape.micro_batch * self.shape.seq * self.ep

    def schedules(self) -> list[str]:
        return [*megatron_schedules(self.shape, self.pp), *OUR_SCHEDULES, TUNED,
                *(plain_gpt.PLAIN_SCHEDULES if self.plain else ())]


def quiet_megatron_imports() -> None:
    """Silence, in this process, what importing Megatron says about missing TE, Apex and CUDA."""
    warnings.simplefilter("ignore")
    for name in ("megatron", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)


def start_worker(rank: int, world: int, port: int) -> None:
    """One benchmark process: Megatron's import noise off, one thread, gloo over localhost, CPU compat."""
    quiet_megatron_imports()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    from dualpipe_megatron.megatron.cpu_compat import install_cpu_compat

    install_cpu_compat()


def check(config: BenchConfig) -> None:
    """Refuse, before launching, what some schedule of the configuration cannot run."""
    from dualpipe_megatron.megatron.model import check_configuration

    for schedule in OUR_SCHEDULES:
        try:
            check_configuration(schedule, config.pp, config.microbatches, config.shape.layers)
        except ValueError as exc:
            raise SystemExit(f"{config.name}: {exc}") from None
    if config.microbatches % config.pp:
        raise SystemExit(f"{config.name}: Megatron's interleaved schedule needs the micro-batch count "
                         f"({config.microbatches}) to be a multiple of the pipeline size ({config.pp})")
    if config.shape.hidden % config.shape.heads:
        raise SystemExit(f"{config.name}: hidden size {config.shape.hidden} is not a multiple of "
                         f"{config.shape.heads} heads")
    if config.shape.experts and config.shape.experts % config.ep:
        raise SystemExit(f"{config.name}: {config.shape.experts} experts do not split over EP={config.ep}")


def _worker(rank: int, config: BenchConfig, port: int, out_dir: str, traces: Path) -> None:
    start_worker(rank, config.world, port)
    clock = ComputeClock()
    time_megatron_compute(clock)
    variants = megatron_gpt.build([*megatron_schedules(config.shape, config.pp), *OUR_SCHEDULES], config.shape,
                                  config.pp, config.ep, config.microbatches, clock, traces)
    if config.plain:
        variants += plain_gpt.build(config.shape, config.pp, config.microbatches, traces)
    for _ in range(config.warmup):
        for v in variants:
            v.warm_up()
    measured = variants[[v.name for v in variants].index("dualpipev")]
    for _ in range(CALIBRATION_STEPS):
        measured.warm_up()
    dist.barrier()  # every rank's calibration steps are on disk
    tuned, tuned_info = megatron_gpt.tuned_variant(config.shape, config.pp, config.ep, config.microbatches,
                                                   traces)
    for _ in range(config.warmup):
        tuned.warm_up()
    variants.insert(variants.index(measured) + 1, tuned)
    for r in range(config.repeats):
        for v in variants if r % 2 == 0 else variants[::-1]:
            v.timed_step()
    for v in variants:
        v.memory_step()
    gathered: list = [None] * config.world
    dist.all_gather_object(gathered, {v.name: v.summary() for v in variants})
    if rank == 0:
        with open(os.path.join(out_dir, "summary.pkl"), "wb") as f:
            pickle.dump({"ranks": gathered, "tuned": tuned_info}, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(config: BenchConfig, keep_traces: Path | None) -> dict:
    port = free_port()
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out_dir:
        traces = keep_traces / config.name if keep_traces else Path(out_dir) / "traces"
        mp.start_processes(_worker, args=(config, port, out_dir, traces), nprocs=config.world,
                           start_method="spawn")
        with open(os.path.join(out_dir, "summary.pkl"), "rb") as f:
            got = pickle.load(f)
    return {"name": config.name, "pp": config.pp, "ep": config.ep, "dp": config.ep, "world": config.world,
            "microbatches": config.microbatches, "tokens_per_step": config.tokens_per_step,
            "shape": asdict(config.shape), "warmup": config.warmup, "repeats": config.repeats,
            "wall_s": time.perf_counter() - start, "load_1min": [load_before, os.getloadavg()[0]],
            "megatron_1f1b_embedding_loss_accounting": megatron_gpt.accounting_effect(config.shape, config.pp),
            "tuned": got["tuned"], "schedules": summarize(got["ranks"], config.tokens_per_step)}


def machine() -> dict[str, object]:
    """What the figures were measured on (Linux /proc where present)."""
    facts: dict[str, object] = {"cpus": os.cpu_count(), "arch": platform.machine(), "os": platform.platform()}
    for path, key, field in (("/proc/cpuinfo", "cpu", "model name"), ("/proc/meminfo", "memory", "MemTotal")):
        try:
            with open(path) as f:
                facts[key] = next(line.split(":", 1)[1].strip() for line in f if line.startswith(field))
        except (OSError, StopIteration):
            pass
    return facts


def configs(args: argparse.Namespace) -> dict[str, BenchConfig]:
    dense = GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                     micro_batch=args.micro_batch, vocab=args.vocab)
    moe = replace(dense, experts=4, expert_ffn=2 * args.hidden)
    common = dict(microbatches=args.microbatches, warmup=args.warmup, repeats=args.repeats)
    return {
        "dense-p2": BenchConfig("dense-p2", 2, 1, dense, plain=True, **common),
        "dense-p4": BenchConfig("dense-p4", 4, 1, dense, plain=True, **common),
        "moe-p2-ep2": BenchConfig("moe-p2-ep2", 2, 2, moe, plain=False, **common),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                        help="dense GPT at P=2 (2 processes) and P=4 (4), MoE GPT at EP=2 x P=2 (4)")
    parser.add_argument("--repeats", type=int, default=12, help="timed rounds (each runs every schedule once)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--microbatches", type=int, default=8, help="M, the same for every schedule")
    parser.add_argument("--layers", type=int, default=DENSE.layers)
    parser.add_argument("--hidden", type=int, default=DENSE.hidden)
    parser.add_argument("--heads", type=int, default=DENSE.heads)
    parser.add_argument("--seq", type=int, default=DENSE.seq)
    parser.add_argument("--micro-batch", type=int, default=DENSE.micro_batch, help="sequences per micro-batch")
    parser.add_argument("--vocab", type=int, default=DENSE.vocab)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--keep-traces", type=Path, metavar="DIR",
                        help="keep our schedules' op traces in DIR/CONFIG/SCHEDULE (for python -m "
                             "dualpipe_megatron.trace analyze); by default they are deleted")
    args = parser.parse_args()
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1 and --warmup at least 0")

    chosen = [configs(args)[name] for name in args.configs]
    quiet_megatron_imports()
    for config in chosen:
        check(config)
    results = []
    for config in chosen:
        print(f"{config.name}: {config.world} processes, {len(config.schedules())} schedules, "
              f"{config.warmup} + {config.repeats} rounds ...", flush=True)
        results.append(measure(config, args.keep_traces))
        done = results[-1]
        print(f"{config.name}: done in {done['wall_s']:.0f} s; 1-minute load average "
              f"{done['load_1min'][0]:.1f} before, {done['load_1min'][1]:.1f} after; tuned dualpipev: layout "
              f"{done['tuned']['layout']}, order optimized for {done['tuned']['stage_costs_from']} stage costs; "
              f"1F1B with the embedding and loss counted in its split: "
              f"{done['megatron_1f1b_embedding_loss_accounting']}", flush=True)

    table = markdown(results)
    print("\n" + table)
    meta = {
        "what": "one forward_backward_func call per step, fenced by barriers, CPU/gloo, no optimizer",
        "date": datetime.date.today().isoformat(), "machine": machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "megatron_core": version("megatron-core"), "threads_per_process": 1,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"meta": meta, "table": table, "configs": results}, indent=1) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
