"""What the executor's op ranges cost while no profiler records (``dualpipe_megatron/runtime/profiler_ranges.py``).

Three measurements, one process (CPU, gloo world of 1, DualPipeV with both
stages on the one rank, 4x4 ``nn.Linear`` stages, so a step is almost all
runtime overhead and each op is as cheap as the runtime allows):

1. helper: ns per ``with op_range(op): pass`` with no profiler on, minus the
   same loop with ``pass`` alone; median of interleaved repeats;
2. op: the runtime's mean time per executed op (a step's time / its ops);
3. steps: interleaved steps of the executor as shipped and with ``op_range``
   replaced by a function returning the shared no-op without asking whether
   a profiler is on; median step time of each and their ratio.

Prints the figures and helper / op. For reference it also prints what making a
``record_function`` range per op would cost unconditionally.

Run: ``.venv/bin/python bench/profiler_ranges_overhead.py [--repeats 21] [--microbatches 16]``.
"""

from __future__ import annotations

import argparse
import time
from statistics import median
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dualpipe_megatron.runtime import Pipeline, executor, profiler_ranges
from dualpipe_megatron.schedules import F, Key, build_schedule
from dualpipe_megatron.schedules.ir import halves
from ports import free_port  # bench/ modules: this script's directory is on sys.path

HIDDEN = 4
MICRO_ROWS = 2
CALLS = 100_000


def per_call_ns(body: Callable[[], None], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        body()
    return (time.perf_counter_ns() - start) / calls


def helper_ns(repeats: int) -> dict[str, float]:
    """ns per op of the range helper (profiler off) and of an unconditional record_function."""
    parts = halves(build_schedule("dualpipev", 2, 8).ops[0][7])  # an F&B pair
    op_range, record_function, name = profiler_ranges.op_range, profiler_ranges.record_function, profiler_ranges.range_name

    def bare() -> None:
        pass

    def ranged() -> None:
        with op_range(parts):
            pass

    def always() -> None:
        with record_function(name(parts)):
            pass

    samples: dict[str, list[float]] = {"bare": [], "ranged": [], "always": []}
    for _ in range(repeats):
        for label, body in (("bare", bare), ("ranged", ranged), ("always", always)):
            samples[label].append(per_call_ns(body, CALLS))
    base = median(samples["bare"])
    return {"op_range_off_ns": median(samples["ranged"]) - base,
            "record_function_always_ns": median(samples["always"]) - base}


def step_times(repeats: int, microbatches: int) -> dict[str, float]:
    """Median step ms, shipped vs the profiler check removed, and ms per executed op."""
    torch.manual_seed(0)
    pipe = Pipeline([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)], "dualpipev",
                    p2p_shapes=[(MICRO_ROWS, HIDDEN)], p2p_dtype=torch.float32)
    x = torch.randn(microbatches * MICRO_ROWS, HIDDEN)
    y = torch.randn(microbatches * MICRO_ROWS, HIDDEN)

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).sum()

    def step() -> float:
        start = time.perf_counter()
        pipe.step(x, num_microbatches=microbatches, criterion=loss, labels=[y])
        pipe.zero_grad()
        return time.perf_counter() - start

    shipped, unchecked = executor.op_range, lambda parts: profiler_ranges._OFF
    assert shipped((F(Key(0, 0, 0)),)) is profiler_ranges._OFF, "a profiler is on"
    times: dict[str, list[float]] = {"shipped": [], "unchecked": []}
    for _ in range(3):
        step()
    for i in range(repeats):
        order = (("shipped", shipped), ("unchecked", unchecked))
        for label, fn in order if i % 2 == 0 else order[::-1]:
            executor.op_range = fn
            times[label].append(step())
    executor.op_range = shipped
    ops = len(build_schedule("dualpipev", 1, microbatches).ops[0])
    ms = {label: 1e3 * median(t) for label, t in times.items()}
    return {"ops_per_step": ops, "shipped_ms": ms["shipped"], "unchecked_ms": ms["unchecked"],
            "op_us": 1e3 * ms["shipped"] / ops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--microbatches", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        helper = helper_ns(args.repeats)
        steps = step_times(4 * args.repeats, args.microbatches)
    finally:
        dist.destroy_process_group()
    op_ns = 1e3 * steps["op_us"]
    rows = [
        ("op_range, no profiler on", f"{helper['op_range_off_ns']:.0f} ns per op"),
        ("record_function made unconditionally", f"{helper['record_function_always_ns']:.0f} ns per op"),
        ("runtime op (4x4 Linear stages)",
         f"{op_ns:.0f} ns per op ({steps['ops_per_step']} ops, {steps['shipped_ms']:.3f} ms per step)"),
        ("helper / op", f"{helper['op_range_off_ns'] / op_ns:.2e}"),
        ("step median, shipped / check removed",
         f"{steps['shipped_ms'] / steps['unchecked_ms']:.4f} ({steps['shipped_ms']:.3f} / "
         f"{steps['unchecked_ms']:.3f} ms, {4 * args.repeats} steps each, interleaved)"),
    ]
    for label, value in rows:
        print(f"{label + ':':40s}{value}")

if __name__ == "__main__":
    main()
