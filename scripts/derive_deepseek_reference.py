"""Derive DeepSeek's DualPipe/DualPipeV op lists and their bubble/activation figures.

Clones deepseek-ai/DualPipe at a pinned commit and runs its ``step()`` once per
rank, in one process, with its compute and communication methods replaced by
recorders, so the op order is exactly what that code executes. Each recorded
order is turned into contract ops (micro-batches in order per phase, deferred
weight grads FIFO, as the reference's ``WeightGradStore`` pops them).

Two files come out, both test vectors (no DualPipe code is stored):

- ``--golden`` (tests/data/deepseek_golden_ops.json): the per-rank op lists for
  P <= 8 (five M per P) and P = 16 at M = 2P, compared op for op with our
  generators by ``tests/test_schedule_golden.py``;
- ``--figures`` (tests/data/deepseek_reference.json): max bubble and peak
  activations from our simulator, for P = 2..16, checked by
  ``tests/test_schedule_figures.py``.

The run also compares every recorded case (the figures' whole grid) with our
generators and exits 1 naming the first differing op if any differs.

    python scripts/derive_deepseek_reference.py            # clones from GitHub
    python scripts/derive_deepseek_reference.py --repo PATH_OR_URL
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

import torch
import torch.nn as nn

from dualpipe_megatron.schedules import B, F, FB, Key, Op, Schedule, W, build_schedule, simulate
from dualpipe_megatron.schedules.simulate import Costs

COSTS = [("1", "2", "1", "3"), ("1", "2", "0.8", "2.5"), ("1", "2", "0.5", "2.4")]
LATENCIES = ["0", "0.1"]
DUALPIPE_URL = "https://github.com/deepseek-ai/DualPipe"
DUALPIPE_COMMIT = "3da1bbe"
DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
TOKENS = (
    "one string per rank, ops separated by spaces: F<d>.<s>.<m> forward, B<d>.<s>.<m> full "
    "backward (w=true), b<d>.<s>.<m> input-grad-only backward (w=false), W<d>.<s>.<m> deferred "
    "weight grad, <F token>+<B or b token> an overlapped F&B pair"
)


def checkout(source: str, commit: str, into: str) -> str:
    """Clone ``source`` (URL or local repository) into ``into`` at ``commit``; the full sha."""
    subprocess.run(["git", "clone", "--quiet", source, into], check=True)
    subprocess.run(["git", "-C", into, "checkout", "--quiet", commit], check=True)
    out = subprocess.run(["git", "-C", into, "rev-parse", "HEAD"], check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


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
    """Every (schedule, P, M) recorded: all DeepSeek's ``step()`` accepts of five M per P."""
    out = []
    for ranks in range(2, 17):
        for m in sorted({2 * ranks, 2 * ranks + 1, 2 * ranks + 2, 3 * ranks, 4 * ranks}):
            out.append(("dualpipev", ranks, m))
            if ranks % 2 == 0 and m % 2 == 0:
                out.append(("dualpipe", ranks, m))
    return out


def stored_golden(ranks: int, microbatches: int) -> bool:
    """The cases whose op lists are stored: the file stays ~120 kB (all of them: ~900 kB)."""
    return ranks <= 8 or (ranks == 16 and microbatches == 2 * ranks)


def token(op: Op) -> str:
    """One op in the compact notation of ``TOKENS``."""
    if isinstance(op, FB):
        return f"{token(op.f)}+{token(op.b)}"
    kind = "F" if isinstance(op, F) else "W" if isinstance(op, W) else "B" if op.w else "b"
    return f"{kind}{op.key.d}.{op.key.s}.{op.key.m}"


def tokens(sched: Schedule) -> list[list[str]]:
    """Each rank's op list in the notation of ``TOKENS``."""
    return [[token(op) for op in rank_ops] for rank_ops in sched.ops]


def first_difference(
    name: str, ranks: int, microbatches: int, theirs: list[list[str]]
) -> str | None:
    """The first op where our generator departs from DeepSeek's lists ``theirs``, or None."""
    ours = tokens(build_schedule(name, ranks, microbatches))
    where = f"{name} P={ranks} M={microbatches}"
    if len(ours) != len(theirs):
        return f"{where}: {len(ours)} ranks, DeepSeek's {len(theirs)}"
    for rank, (mine, ref) in enumerate(zip(ours, theirs)):
        for index in range(max(len(mine), len(ref))):
            a = mine[index] if index < len(mine) else "(end)"
            b = ref[index] if index < len(ref) else "(end)"
            if a != b:
                return f"{where} rank {rank} op {index}: ours {a}, DeepSeek's {b}"
    return None


def figure_rows(sched: Schedule) -> list[dict]:
    rows = []
    for f, b, w, fb in COSTS:
        for c in LATENCIES:
            res = simulate(sched, Costs.of(f, b, w, fb, c))
            rows.append({
                "schedule": sched.name, "ranks": sched.ranks, "microbatches": sched.microbatches,
                "F": f, "B": b, "W": w, "FB": fb, "c": c,
                "max_bubble": str(res.max_bubble),
                "peak_activations": [r.peak_activations for r in res.per_rank],
            })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=DUALPIPE_URL,
                        help="deepseek-ai/DualPipe to clone: a URL or a local repository")
    parser.add_argument("--commit", default=DUALPIPE_COMMIT, help="the DualPipe commit to record")
    parser.add_argument("--golden", type=Path, default=DATA / "deepseek_golden_ops.json")
    parser.add_argument("-o", "--figures", type=Path, default=DATA / "deepseek_reference.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sha = checkout(args.repo, args.commit, tmp)
        sys.path.insert(0, tmp)
        import dualpipe  # noqa: PLC0415  (the checkout is only on the path now)
        import dualpipe.comm

        dualpipe.comm.set_p2p_tensor_shapes([(1, 1)])
        dualpipe.comm.set_p2p_tensor_dtype(torch.float32)
        classes = {"dualpipev": dualpipe.DualPipeV, "dualpipe": dualpipe.DualPipe}
        scheds = [to_schedule(name, p, m, [record_rank(classes[name], p, r, m) for r in range(p)])
                  for name, p, m in cases()]
    found = (first_difference(s.name, s.ranks, s.microbatches, tokens(s)) for s in scheds)
    differences = [d for d in found if d]
    golden = {
        "meta": {
            "source": f"{DUALPIPE_URL} step() (dualpipe/dualpipe.py, dualpipe/dualpipev.py)",
            "commit": sha,
            "how": "scripts/derive_deepseek_reference.py: the op order recorded from that code",
            "format": TOKENS,
        },
        "cases": [
            {"schedule": s.name, "ranks": s.ranks, "microbatches": s.microbatches,
             "ops": [" ".join(rank_ops) for rank_ops in tokens(s)]}
            for s in scheds if stored_golden(s.ranks, s.microbatches)
        ],
    }
    args.golden.write_text(json.dumps(golden, indent=0) + "\n")
    figures = {
        "meta": {
            "source": "deepseek-ai/DualPipe step() (dualpipe/dualpipe.py, dualpipe/dualpipev.py)",
            "commit": sha[:7],
            "how": "scripts/derive_deepseek_reference.py: recorded op order, timed by our simulator",
        },
        "rows": [row for s in scheds for row in figure_rows(s)],
    }
    with open(args.figures, "w") as fh:
        json.dump(figures, fh, indent=0)
    print(f"DualPipe {sha}: {len(scheds)} cases recorded, {len(golden['cases'])} op lists "
          f"written to {args.golden}, {len(figures['rows'])} figure rows to {args.figures}")
    for line in differences:
        print(f"differs from our generator: {line}", file=sys.stderr)
    print("all cases equal our generators op for op" if not differences
          else f"{len(differences)} cases differ from our generators")
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
