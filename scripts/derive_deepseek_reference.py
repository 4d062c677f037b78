"""Derive the reference bubble/activation figures of DeepSeek's DualPipe op order.

Runs the ``step()`` of a checkout of deepseek-ai/DualPipe once per rank, in one
process, with its compute and communication methods replaced by recorders, so
the op order is exactly what that code executes. Each recorded order is turned
into contract ops (micro-batches in order per phase, deferred weight grads
FIFO, as the reference's ``WeightGradStore`` pops them) and timed with our
simulator. The figures are written as JSON for ``tests/test_deepseek_reference.py``.

    python scripts/derive_deepseek_reference.py --dualpipe-repo PATH -o tests/data/deepseek_reference.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque

import torch
import torch.nn as nn

from dualpipe_megatron.schedules import B, F, FB, Key, Schedule, W, simulate
from dualpipe_megatron.schedules.simulate import Costs

COSTS = [("1", "2", "1", "3"), ("1", "2", "0.8", "2.5"), ("1", "2", "0.5", "2.4")]
LATENCIES = ["0", "0.1"]


def record_rank(cls: type, ranks: int, rank: int, microbatches: int) -> list[tuple]:
    """Phase-level ops the reference ``step()`` runs on ``rank``."""
    log: list[tuple] = []
    pipe = cls.__new__(cls)
    nn.Module.__init__(pipe)
    pipe.module = nn.ModuleList([nn.Identity(), nn.Identity()])
    pipe.overlapped_forward_backward = False
    pipe.batch_dim = 0
    pipe.num_ranks = ranks
    pipe.rank = rank
    pipe.is_first_rank = rank == 0
    pipe.is_last_rank = rank == ranks - 1
    pipe.is_in_second_half = rank >= ranks // 2
    pipe.is_middle_rank = rank in (ranks // 2 - 1, ranks // 2)
    pipe._forward_compute_chunk = lambda phase: log.append(("F", phase))
    pipe._backward_compute_chunk = lambda phase, enable_zb=False: log.append(("B", phase, not enable_zb))
    pipe._forward_backward_compute_chunk = lambda p0, p1: log.append(("FB", p0, p1))
    pipe._weight_chunk = lambda: log.append(("W",))
    for name in ("_recv_forward", "_send_forward", "_recv_backward", "_send_backward"):
        setattr(pipe, name, lambda *a, **k: None)
    pipe._commit_and_wait_comm = lambda: None
    x = torch.zeros(microbatches, 1)
    with torch.no_grad():  # no loss to stack; the recorded op order does not depend on it
        pipe.step(x, num_chunks=microbatches)
    return log


def to_schedule(name: str, ranks: int, microbatches: int, logs: list[list[tuple]]) -> Schedule:
    if name == "dualpipev":
        stages, directions = 2 * ranks, 1
        phase_stage = [((0, r), (0, stages - 1 - r)) for r in range(ranks)]
    else:
        stages, directions = ranks, 2
        phase_stage = [
            ((0, r), (1, ranks - 1 - r)) if r < ranks // 2 else ((1, ranks - 1 - r), (0, r))
            for r in range(ranks)
        ]
    ops = []
    for rank, log in enumerate(logs):
        nf, nb, fifo, rank_ops = [0, 0], [0, 0], deque(), []

        def key(phase: int, counter: list[int]) -> Key:
            d, s = phase_stage[rank][phase]
            counter[phase] += 1
            return Key(d, s, counter[phase] - 1)

        for entry in log:
            if entry[0] == "F":
                rank_ops.append(F(key(entry[1], nf)))
            elif entry[0] == "B":
                k = key(entry[1], nb)
                if not entry[2]:
                    fifo.append(k)
                rank_ops.append(B(k, entry[2]))
            elif entry[0] == "W":
                rank_ops.append(W(fifo.popleft()))
            else:
                rank_ops.append(FB(F(key(entry[1], nf)), B(key(entry[2], nb), True)))
        ops.append(rank_ops)
    placement = {}
    for rank, phases in enumerate(phase_stage):
        for ds in phases:
            placement[ds] = rank
    return Schedule(name, ranks, stages, microbatches, directions, ops, placement)


def cases() -> list[tuple[str, int, int]]:
    out = []
    for ranks in range(2, 17):
        for m in sorted({2 * ranks, 2 * ranks + 1, 2 * ranks + 2, 3 * ranks, 4 * ranks}):
            out.append(("dualpipev", ranks, m))
            if ranks % 2 == 0 and m % 2 == 0:
                out.append(("dualpipe", ranks, m))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dualpipe-repo", required=True, help="checkout of deepseek-ai/DualPipe")
    parser.add_argument("-o", "--output", required=True)
    args = parser.parse_args()
    sys.path.insert(0, args.dualpipe_repo)
    import dualpipe  # noqa: PLC0415  (the checkout is only on the path now)
    import dualpipe.comm

    dualpipe.comm.set_p2p_tensor_shapes([(1, 1)])
    dualpipe.comm.set_p2p_tensor_dtype(torch.float32)
    classes = {"dualpipev": dualpipe.DualPipeV, "dualpipe": dualpipe.DualPipe}
    rows = []
    for name, ranks, m in cases():
        sched = to_schedule(name, ranks, m, [record_rank(classes[name], ranks, r, m) for r in range(ranks)])
        for f, b, w, fb in COSTS:
            for c in LATENCIES:
                res = simulate(sched, Costs.of(f, b, w, fb, c))
                rows.append({
                    "schedule": name, "ranks": ranks, "microbatches": m,
                    "F": f, "B": b, "W": w, "FB": fb, "c": c,
                    "max_bubble": str(res.max_bubble),
                    "peak_activations": [r.peak_activations for r in res.per_rank],
                })
    meta = {
        "source": "deepseek-ai/DualPipe step() (dualpipe/dualpipe.py, dualpipe/dualpipev.py)",
        "commit": "3da1bbe",
        "how": "scripts/derive_deepseek_reference.py: recorded op order, timed by our simulator",
    }
    with open(args.output, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=0)
    print(f"wrote {len(rows)} reference rows to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
