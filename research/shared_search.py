"""The op-order search on the training path: every pipeline rank running all of it, against the
ranks sharing it (runtime/shared_search.py), in real processes on this machine.

Run ``.venv/bin/python research/shared_search.py [-P 16] [-M 128] [--budgets 25,none] [--costs paired]``;
not part of ``make test``. ``--costs``: ``uniform`` (F 1, B 2, W 1, F&B 3: no pair saves time,
the training path's default) or ``paired`` (W 0.5, F&B 2.4 = 0.8 (F+B), where the budgeted
search also tries per-rank pairing policies). It starts P gloo processes; for each budget each
rank times, from a common barrier, the search alone (what every rank did before: all ranks at
once, each running the whole search) and shared (rank r runs pieces r, r + P, ...; an
all-gather gives every rank every result), and checks both give the same order. It prints the slowest rank's seconds per mode, the
CPU seconds of the busiest rank when shared, and one process running the search with the machine
to itself. With P processes on a machine with fewer cores they share the cores: the time all
ranks need is the figure, not one rank's. With a core per rank (a GPU node) each round of pieces
ends at a gather, so the shared search takes about the sum over rounds of the slowest rank's CPU
in that round; the last column is that sum, from each rank's measured CPU per round (the
gathers' own cost left out).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
import torch.multiprocessing as mp

from dualpipe_megatron.runtime.shared_search import RankWorkers
from dualpipe_megatron.schedules import Costs, build_schedule
from dualpipe_megatron.schedules.cli import markdown_table
from dualpipe_megatron.schedules.optimize import optimize_order


class _RoundTimedWorkers(RankWorkers):
    """RankWorkers that keep this rank's CPU seconds spent in each round's pieces."""

    def __init__(self, group: dist.ProcessGroup, inputs: dict[str, str]) -> None:
        super().__init__(group, inputs)
        self.rounds: list[float] = []

    def map(self, fn: Callable[[Any], Any], tasks: Sequence[Any]) -> list[Any]:
        spent = 0.0

        def timed(task: Any) -> Any:
            nonlocal spent
            cpu = time.process_time()
            try:
                return fn(task)
            finally:
                spent += time.process_time() - cpu

        out = super().map(timed, tasks)
        self.rounds.append(spent)
        return out


COSTS = {"uniform": Costs.of(), "paired": Costs.of(1, 2, "0.5", "2.4")}


def _timed(sched, costs: Costs, budget: Optional[int], workers: Optional[RankWorkers]) -> tuple[float, float, list]:
    """Wall and CPU seconds of this rank's search, from a barrier."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out = optimize_order(sched, costs, max_activations=budget, workers=workers)
    return time.perf_counter() - start, time.process_time() - cpu, out.ops


def _rank(rank: int, ranks: int, rendezvous: str, microbatches: int, costs: Costs, budgets: list, results) -> None:
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=ranks)
    sched = build_schedule("dualpipev", ranks, microbatches)
    for budget in budgets:
        alone, _, ops_alone = _timed(sched, costs, budget, None)
        workers = _RoundTimedWorkers(dist.group.WORLD, {"budget": repr(budget)})
        shared, cpu, ops_shared = _timed(sched, costs, budget, workers)
        every: list[Any] = [None] * ranks
        dist.all_gather_object(every, workers.rounds)
        critical = sum(max(round_cpu) for round_cpu in zip(*every))
        results.put((budget, rank, alone, shared, ops_alone == ops_shared, cpu, critical))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-P", "--ranks", type=int, default=16)
    parser.add_argument("-M", "--microbatches", type=int, default=128)
    parser.add_argument("--budgets", default="25,none", help="comma-separated K per rank, or none")
    parser.add_argument("--costs", choices=sorted(COSTS), default="uniform")
    args = parser.parse_args()
    costs = COSTS[args.costs]
    budgets = [None if b == "none" else int(b) for b in args.budgets.split(",")]
    sched = build_schedule("dualpipev", args.ranks, args.microbatches)
    one = {}
    for budget in budgets:
        start = time.perf_counter()
        optimize_order(sched, costs, max_activations=budget)
        one[budget] = time.perf_counter() - start
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as scratch:  # a file rendezvous: no port to find
        rendezvous = f"file://{os.path.join(scratch, 'rendezvous')}"
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, rendezvous, args.microbatches, costs, budgets, results))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        got = [results.get(timeout=1800) for _ in range(args.ranks * len(budgets))]
        for p in procs:
            p.join()
    rows = []
    for budget in budgets:
        mine = [g for g in got if g[0] == budget]
        rows.append([f"K = {budget}" if budget is not None else "no budget", f"{one[budget]:.1f}",
                     f"{max(g[2] for g in mine):.1f}", f"{max(g[3] for g in mine):.1f}",
                     f"{max(g[5] for g in mine):.1f}", f"{mine[0][6]:.1f}", str(all(g[4] for g in mine))])
    print(f"DualPipeV P={args.ranks} M={args.microbatches}, {args.costs} costs, {os.cpu_count()} CPUs")
    print(markdown_table(["budget", "one process alone (s)", f"{args.ranks} ranks, each all of it (s)",
                          f"{args.ranks} ranks sharing it (s)", "its busiest rank's CPU (s)",
                          "sum of each round's slowest rank's CPU (s)", "same order"], rows))


if __name__ == "__main__":
    main()
