"""Per-step overhead of our DualPipeV runtime against torch's ScheduleDualPipeV (CPU, gloo).

Stages are 4x4 ``nn.Linear`` layers, so a step's time is almost all runtime
overhead: scheduling, p2p posting and waiting, autograd plumbing. For each
pipeline size P, P processes run both pipelines on the same layers and batch,
alternating steps (ours, torch's, ours, ...) so drifts in machine load hit
both alike; each timed step is fenced by barriers and timed on rank 0. Prints a
markdown table and writes ``bench/results/runtime_overhead.json``.

Run: ``.venv/bin/python bench/bench_runtime.py [--ranks 2 4] [--repeats 30]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ports import free_port  # bench/ modules: this script's directory is on sys.path

HIDDEN = 4
MICRO_ROWS = 2
WARMUP = 3
RESULTS = Path(__file__).resolve().parent / "results" / "runtime_overhead.json"


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def _worker(rank: int, world: int, port: int, microbatches: int, repeats: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    from dualpipe_megatron.runtime import Pipeline

    torch.manual_seed(0)
    layers = [nn.Linear(HIDDEN, HIDDEN) for _ in range(2 * world)]
    held = (rank, 2 * world - 1 - rank)
    ours = Pipeline(
        [nn.Linear(HIDDEN, HIDDEN) for _ in held], "dualpipev",
        p2p_shapes=[(MICRO_ROWS, HIDDEN)], p2p_dtype=torch.float32,
    )
    for module, s in zip(ours.module, held):
        module.load_state_dict(layers[s].state_dict())
    stages = [PipelineStage(layers[s], s, 2 * world, torch.device("cpu")) for s in held]
    theirs = ScheduleDualPipeV(stages, microbatches, loss_fn=_loss, scale_grads=False)

    x = torch.randn(microbatches * MICRO_ROWS, HIDDEN)
    y = torch.randn(microbatches * MICRO_ROWS, HIDDEN)

    def step_ours() -> None:
        ours.step(*([x] if rank == 0 else []), num_microbatches=microbatches, criterion=_loss,
                  labels=[y] if rank == 0 else [])

    def step_theirs() -> None:
        if rank == 0:
            theirs.step(x, target=y, losses=[])
        else:
            theirs.step()

    times: dict[str, list[float]] = {"ours": [], "torch": []}
    for i in range(WARMUP + repeats):
        for name, step in (("ours", step_ours), ("torch", step_theirs)):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        with open(os.path.join(out_dir, "times.pkl"), "wb") as f:
            pickle.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, microbatches: int, repeats: int) -> dict[str, list[float]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(
            _worker, args=(world, port, microbatches, repeats, out_dir), nprocs=world, start_method="spawn",
        )
        with open(os.path.join(out_dir, "times.pkl"), "rb") as f:
            return pickle.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--microbatches-per-rank", type=int, default=4, help="M = this x P")
    args = parser.parse_args()

    rows = []
    for world in args.ranks:
        m = args.microbatches_per_rank * world
        times = measure(world, m, args.repeats)
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["torch"])
        rows.append({
            "ranks": world, "microbatches": m, "repeats": args.repeats,
            "ours_median_ms": ours * 1e3, "torch_median_ms": theirs * 1e3, "ratio": ours / theirs,
            "ours_ms": [t * 1e3 for t in times["ours"]], "torch_ms": [t * 1e3 for t in times["torch"]],
        })

    print("| P | M | ours median (ms) | torch ScheduleDualPipeV median (ms) | ours / torch |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['microbatches']} | {r['ours_median_ms']:.2f} | "
              f"{r['torch_median_ms']:.2f} | {r['ratio']:.2f} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "what": "per-step time of DualPipeV with 4x4 Linear stages, CPU/gloo, rank 0 between barriers",
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "hidden": HIDDEN, "micro_rows": MICRO_ROWS, "warmup": WARMUP,
    }
    RESULTS.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
