"""Two pipeline ranks of the native runtime on one device, checked against one process.

Launched by ``scripts/gpu_check.sh`` (section ``nccl_two_rank``); by hand:

    NCCL_MULTI_RANK_GPU_ENABLE=1 torchrun --standalone --nproc-per-node 2 scripts/nccl_two_rank.py
    torchrun --standalone --nproc-per-node 2 scripts/nccl_two_rank.py --device cpu   # gloo

Both ranks share ``cuda:0`` (backend nccl; NCCL >= 2.30 with ``NCCL_MULTI_RANK_GPU_ENABLE=1``
allows two ranks per GPU) or the CPU (gloo). For each schedule (dualpipev, then dualpipe) it
runs ``--steps`` training steps with an SGD update after each, then one forward-only step, and
compares every step's loss and (training steps) every gradient with the whole model run in one
process on the same device, with the same weights and updates; then the op-order search shared
by the two ranks (``runtime_workers.shared_search``). The default CUDA sizes make each
activation message 8 MiB, twice NCCL's default 4 MiB buffer, so sends really rendezvous.

The model, loss and single-process reference are the CPU tests' (``tests/runtime_workers.py``).
Rank 0 prints one line per step and ``RESULT: PASS`` or ``RESULT: FAIL``; the exit code is 0
only on PASS.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEDULES = ("dualpipev", "dualpipe")
# (hidden, rows per micro-batch): 1024 x 2048 fp32 = 8 MiB per activation message on CUDA.
SIZES = {"cuda": (2048, 1024), "cpu": (32, 4)}
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}  # relative, loss and gradient norms


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda (nccl, both ranks on cuda:0) or cpu (gloo); default: cuda if available")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: 2048 cuda, 32 cpu)")
    parser.add_argument("--rows", type=int, default=None, help="rows per micro-batch (default: 1024 cuda, 4 cpu)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="training steps per schedule")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    parser.add_argument("--lr", type=float, default=1e-4, help="SGD learning rate between steps")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one p2p wait may take")
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> bool:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tests"))
    import runtime_workers as rw
    from dualpipe_megatron.runtime import Pipeline, sync_mirrored_grads
    from dualpipe_megatron.runtime.nccl_version import loaded_nccl_version
    from dualpipe_megatron.schedules import build_schedule

    device_kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hidden, rows = (args.hidden or SIZES[device_kind][0]), (args.rows or SIZES[device_kind][1])
    dtype = getattr(torch, args.dtype)
    if device_kind == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
        torch.set_float32_matmul_precision("highest")  # no TF32: compare fp32 with fp32
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    def sync() -> None:
        if device_kind == "cuda":
            torch.cuda.synchronize()

    def all_reduce(values: list[float], op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    say(f"world {world} on {device} ({dist.get_backend()}), torch {torch.__version__}"
        + (f", NCCL {'.'.join(map(str, loaded_nccl_version()))}" if device_kind == "cuda" else ""))
    message_mib = rows * hidden * dtype.itemsize / 2**20
    say(f"hidden {hidden}, {rows} rows x {args.microbatches} micro-batches, {args.dtype}: "
        f"{message_mib:g} MiB per activation message (NCCL's default buffer: 4 MiB)")
    tol = TOLERANCE[args.dtype]
    ok = True
    for name in args.schedules:
        sched = build_schedule(name, world, args.microbatches)
        torch.manual_seed(rw.SEED)
        layers = [rw.Block(hidden).to(device=device, dtype=dtype) for _ in range(sched.stages)]
        ref_layers = copy.deepcopy(layers)
        modules = [copy.deepcopy(layers[s]) for s in rw.layers_of(sched, rank)]
        g = torch.Generator().manual_seed(rw.SEED + 1)
        x, y = (torch.randn(args.microbatches * rows, hidden, generator=g, dtype=torch.float64)
                .to(device=device, dtype=dtype) for _ in range(2))
        inputs, labels = rw.rank_share(sched, rank, [x], y)
        criterion = rw.SumSquares(y.shape[0])
        pipe = Pipeline(modules, name, p2p_shapes=[(rows, hidden)], p2p_dtype=dtype, timeout=args.timeout)
        for step in range(args.steps + 1):
            training = step < args.steps
            kind = f"train {step + 1}" if training else "forward-only"
            ref = rw.reference(ref_layers, [x], y)
            dist.barrier()
            sync()
            began = time.perf_counter()
            with torch.set_grad_enabled(training):
                loss, _ = pipe.step(*inputs, num_microbatches=args.microbatches, criterion=criterion, labels=labels)
            if training and sched.directions == 2:
                sync_mirrored_grads(modules, timeout=args.timeout)
            sync()
            ms = (time.perf_counter() - began) * 1000
            local_loss = loss.double().sum().item() if loss is not None else 0.0
            grad_abs, grad_rel = 0.0, 0.0
            if training:
                for module, layer in zip(modules, rw.layers_of(sched, rank), strict=True):
                    for p, want in zip(module.parameters(), ref["grads"][layer], strict=True):
                        grad_abs = max(grad_abs, (p.grad - want).abs().max().item())
                        grad_rel = max(grad_rel, rel_err(p.grad, want))
            total, = all_reduce([local_loss], dist.ReduceOp.SUM)
            grad_abs, grad_rel, ms_max = all_reduce([grad_abs, grad_rel, ms], dist.ReduceOp.MAX)
            want_loss = ref["loss"].double().item()
            loss_abs = abs(total - want_loss)
            loss_rel = loss_abs / max(abs(want_loss), 1e-300)
            passed = loss_rel <= tol and grad_rel <= tol
            ok &= passed
            grads = f", grads {grad_abs:.3g} (relative {grad_rel:.2g})" if training else ""
            say(f"{'PASS' if passed else 'FAIL'} {name} {kind}: loss {total:.6g} (reference {want_loss:.6g}); "
                f"max abs diff: loss {loss_abs:.3g} (relative {loss_rel:.2g}){grads}; tolerance {tol:g} relative; "
                f"step {ms_max:.1f} ms")
            if not training:
                continue
            with torch.no_grad():  # the same SGD update on both sides
                for module in modules:
                    for p in module.parameters():
                        if p.grad is not None:
                            p -= args.lr * p.grad
                for layer in ref_layers:
                    for p in layer.parameters():
                        p -= args.lr * p.grad
            pipe.zero_grad(set_to_none=True)
            for layer in ref_layers:
                layer.zero_grad(set_to_none=True)
    # The op-order search shared by the ranks (runtime/shared_search.py): its gathers over this
    # backend, the order equal to one process's, and its errors raised on every rank.
    shared = rw.shared_search(rank, world)
    passed = (shared["same"] and shared["reordered"] and "mismatch" in shared and "failed" in shared
              and shared["merged"] == [(task, task % world) for task in range(5)])
    ok &= passed
    say(f"{'PASS' if passed else 'FAIL'} shared op-order search: {shared}")
    say(f"RESULT: {'PASS' if ok else 'FAIL'}")
    dist.destroy_process_group()
    return ok


def rel_err(got, want) -> float:
    """``|got - want| / |want|`` in norms (the CPU tests' measure)."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


if __name__ == "__main__":
    arguments = parse_args()
    try:
        passed = main(arguments)
    except BaseException:  # noqa: BLE001 - a failed rank must exit at once, not hang in teardown
        print(f"rank {os.environ.get('RANK', '?')}: FAIL\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        os._exit(1)
    sys.stdout.flush()
    os._exit(0 if passed else 1)
