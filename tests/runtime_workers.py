"""Rank processes for tests/test_runtime.py: the pipeline runtime on CPU/gloo.

``launcher.spawn`` runs one of these worker functions on ``world`` processes,
over a whole list of cases (process start dominates the cost, so one launch
runs many checks), and returns every rank's result. Workers never import
Megatron. Comparisons with the single-process reference happen in the test
process; workers only report losses, outputs, gradients and counters.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as TF
from torch import nn

HIDDEN = 8
MICRO_ROWS = 2
SEED = 1234

# -- the model ------------------------------------------------------------------------------------


class Block(nn.Module):
    """One pipeline stage: plain nn.Linear layers (deferrable out of the box) and a LayerNorm."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.tanh(self.fc1(x))))


class HookedBlock(Block):
    """A Block whose class provides DeepSeek's ``overlapped_forward_backward`` hook."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):
        from dualpipe_megatron.runtime import run_backward

        cls.calls += 1
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


class PairBlock(nn.Module):
    """A stage passing two tensors on every edge: a hidden state and a gated side stream."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.block = Block(hidden)
        self.gate = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.block(x + z)
        return h, z * torch.sigmoid(self.gate(h))


def build_layers(count: int, dtype: torch.dtype, hooked: bool = False, pair: bool = False) -> list[nn.Module]:
    """The whole model's layers, identical in every process."""
    torch.manual_seed(SEED)
    cls = PairBlock if pair else HookedBlock if hooked else Block
    return [cls(HIDDEN).to(dtype) for _ in range(count)]


def batch(rows: int, dtype: torch.dtype, pair: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Model inputs (one tensor, or two for PairBlock models) and labels."""
    g = torch.Generator().manual_seed(SEED + 1)
    x, z, y = (torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    return ([x, z] if pair else [x]), y


class SumSquares:
    """Squared error summed over rows and divided by the *whole* batch's rows.

    Per micro-batch losses then add up to the whole-batch loss, so the
    pipeline's summed loss and gradients equal a single full-batch backward.
    A two-tensor output is scored on its sum.
    """

    def __init__(self, total_rows: int) -> None:
        self.total_rows = total_rows

    def __call__(self, *outputs_and_label: torch.Tensor) -> torch.Tensor:
        *outputs, label = outputs_and_label
        return ((sum(outputs) - label) ** 2).sum() / self.total_rows


def layers_of(sched, rank: int) -> list[int]:
    """The model layer each stage module on ``rank`` runs (both DualPipe directions share layers)."""
    return [s for _, s in sched.stages_on(rank)]


def reference(layers: list[nn.Module], inputs: list[torch.Tensor], y: torch.Tensor) -> dict[str, Any]:
    """Whole model, whole batch, one process: loss, outputs and per-layer grads."""
    out = inputs
    for layer in layers:
        out = layer(*out)
        out = [out] if isinstance(out, torch.Tensor) else list(out)
    loss = SumSquares(y.shape[0])(*out, y)
    loss.backward()
    return {
        "loss": loss.detach(),
        "outputs": [o.detach() for o in out],
        "grads": [[p.grad.clone() for p in layer.parameters()] for layer in layers],
    }


def rank_share(
    sched, pp_rank: int, xs: list[torch.Tensor], y: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``pp_rank``'s ``step()`` inputs (where a direction starts) and labels (where one ends).

    Direction d carries rows [d*per_dir, (d+1)*per_dir) of the batch.
    """
    per_dir = y.shape[0] // sched.directions
    rows = [slice(d * per_dir, (d + 1) * per_dir) for d in range(sched.directions)]
    first = [d for d in range(sched.directions) if sched.rank_of(d, 0) == pp_rank]
    last = [d for d in range(sched.directions) if sched.rank_of(d, sched.stages - 1) == pp_rank]
    inputs = [x[rows[first[0]]] for x in xs] if first else []
    labels = [y[rows[last[0]]]] if last else []
    return inputs, labels


# -- the pipeline cases ----------------------------------------------------------------------------


def run_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    """One training step and one forward-only step of ``case`` on this rank.

    With ``reversed`` the pipeline ranks run opposite to the group ranks (``rank_mapping``).
    """
    from dualpipe_megatron.runtime import Pipeline, sync_mirrored_grads
    from dualpipe_megatron.schedules import build_schedule

    dtype = getattr(torch, case["dtype"])
    name, m, pair = case["schedule"], case["microbatches"], case.get("pair", False)
    mapping = [world - 1 - g for g in range(world)] if case.get("reversed") else None
    pp_rank = mapping[rank] if mapping else rank
    sched = build_schedule(name, world, m, chunks=case.get("chunks"))
    layers = build_layers(sched.stages, dtype, hooked=case["hook"], pair=pair)
    modules = [layers[s] for s in layers_of(sched, pp_rank)]
    xs, y = batch(m * MICRO_ROWS, dtype, pair)
    inputs, labels = rank_share(sched, pp_rank, xs, y)
    pipe = Pipeline(
        modules, name, chunks=case.get("chunks"), p2p_shapes=[(MICRO_ROWS, HIDDEN)] * len(xs),
        p2p_dtype=dtype, timeout=30.0, debug=case.get("debug", False), defer_weight_grads=case["defer"],
        rank_mapping=mapping,
    )
    criterion = SumSquares(y.shape[0])
    HookedBlock.calls = 0
    loss, outputs = pipe.step(
        *inputs, num_microbatches=m, criterion=criterion, labels=labels, return_outputs=True
    )
    stats = pipe.stats
    if sched.directions == 2:
        sync_mirrored_grads(modules, rank_mapping=mapping)
    grads = [[p.grad.clone() for p in module.parameters()] for module in modules]
    pipe.zero_grad()
    with torch.no_grad():
        loss_fo, outputs_fo = pipe.step(
            *inputs, num_microbatches=m, criterion=criterion, labels=labels, return_outputs=True
        )
    return {
        "pp_rank": pp_rank, "loss": loss, "outputs": outputs, "grads": grads,
        "peak": stats.peak, "freed": stats.freed, "deferred": stats.deferred, "hook_calls": HookedBlock.calls,
        "loss_fo": loss_fo, "outputs_fo": outputs_fo,
        "untouched_by_forward_only": all(p.grad is None for p in pipe.parameters()),
    }


def expect_error(fn: Callable[[], Any], exc_type: type[BaseException]) -> str:
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"expected {exc_type.__name__}")


def bad_calls(rank: int, world: int) -> dict[str, str]:
    """Wrong inputs raise on the calling rank before any message is posted.

    Only rank 0 calls; if any of these communicated, the cases run after them
    in the same launch would see stray messages and fail.
    """
    from dualpipe_megatron.runtime import Pipeline

    if rank != 0:
        return {}
    layers = build_layers(2 * world, torch.float64)
    (x,), y = batch(4 * world * MICRO_ROWS, torch.float64)
    crit = SumSquares(x.shape[0])

    def pipe(modules=None, **kw):
        kw.setdefault("p2p_shapes", [(MICRO_ROWS, HIDDEN)])
        kw.setdefault("p2p_dtype", torch.float64)
        mods = modules if modules is not None else [layers[0], layers[-1]]
        return Pipeline(mods, "dualpipev", **kw)

    m = 2 * world
    return {
        "modules": expect_error(lambda: pipe([layers[0]]).step(x, num_microbatches=m, criterion=crit, labels=[y]), ValueError),
        "microbatches": expect_error(lambda: pipe().step(x, num_microbatches=world, criterion=crit, labels=[y]), ValueError),
        "inputs": expect_error(lambda: pipe().step(None, num_microbatches=m, criterion=crit, labels=[y]), ValueError),
        "criterion": expect_error(lambda: pipe().step(x, num_microbatches=m, labels=[y]), ValueError),
        "split": expect_error(lambda: pipe().step(x[:-1], num_microbatches=m, criterion=crit, labels=[y[:-1]]), ValueError),
        "shapes": expect_error(lambda: pipe(p2p_shapes=None).step(x, num_microbatches=m, criterion=crit, labels=[y]), ValueError),
    }


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Every case in order; the first failure stops the launch (the group may be out of step)."""
    results: dict[str, Any] = {"bad_calls": bad_calls(rank, world), "shared_search": shared_search(rank, world)}
    for case in cases:
        if case["schedule"] == "compat":
            results[case["id"]] = compat_example(rank, world, case["variant"])
        else:
            results[case["id"]] = run_case(rank, world, case)
    return results


# -- the reference example, ported ---------------------------------------------------------------------


def compat_example(rank: int, world: int, variant: str) -> dict[str, Any]:
    """DeepSeek's examples/example_dualpipe{,v}.py logic with only the import changed (CPU, small):
    what the example checks, as this rank's records (its training and forward-only losses and
    outputs, each with the reference's, and the worst grad diff); test_runtime.py compares them."""
    from dualpipe_megatron.compat import DualPipe, DualPipeV, set_p2p_tensor_dtype, set_p2p_tensor_shapes
    from dualpipe_megatron.compat.utils import WeightGradStore, run_backward

    class LinearFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, weight):
            ctx.save_for_backward(input, weight)
            return TF.linear(input, weight)

        @staticmethod
        def backward(ctx, grad_output):
            input, weight = ctx.saved_tensors
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)

            def grad_weight_fn():
                weight.grad += grad_output.flatten(0, -2).T @ input.flatten(0, -2)

            if WeightGradStore.enabled:
                WeightGradStore.put(grad_weight_fn)
            else:
                grad_weight_fn()
            return grad_output @ weight, None

    class MyLinear(nn.Linear):
        def forward(self, input):
            return LinearFunc.apply(input, self.weight)

    class PipelineStage(nn.Module):
        def __init__(self, hidden_size):
            super().__init__()
            self.linear1 = MyLinear(hidden_size, hidden_size * 4, bias=False)
            self.linear2 = MyLinear(hidden_size * 4, hidden_size, bias=False)

        def forward(self, x):
            return self.linear2(TF.gelu(self.linear1(x)))

        @classmethod
        def overlapped_forward_backward(
            cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
        ):
            outputs0 = module0(*inputs0)
            outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
            loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
            if loss1 is not None:
                loss1.backward()
                loss1.detach_()
            else:
                run_backward(outputs1, output_grads1)
            return outputs0, loss0

    def criterion(output, target):
        return TF.mse_loss(output, target).clone()

    def ref_step(x, l, model, chunks):
        ys, losses = [], []
        for micro_x, micro_l in zip(x.chunk(chunks), l.chunk(chunks)):
            micro_y = model(micro_x)
            loss = criterion(micro_y, micro_l)
            loss.backward()
            ys.append(micro_y)
            losses.append(loss)
        return torch.stack(losses), torch.cat(ys, 0)

    def cal_diff(x, y):
        x, y = x.double(), y.double()
        return 1 - 2 * (x * y).sum().item() / (x * x + y * y).sum().item()

    torch.manual_seed(233)
    num_chunks, micro_batch_size, seq_len, hidden_size = 2 * world + 2, 3, 4, 8
    set_p2p_tensor_shapes([(micro_batch_size, seq_len, hidden_size)])
    set_p2p_tensor_dtype(torch.float32)
    is_first_rank, is_last_rank = rank == 0, rank == world - 1
    v = variant == "dualpipev"
    full_modules = nn.Sequential(*[PipelineStage(hidden_size) for _ in range(world * 2 if v else world)])
    full_x = torch.randn(num_chunks * micro_batch_size, seq_len, hidden_size)
    full_l = torch.randn(num_chunks * micro_batch_size, seq_len, hidden_size)
    loss_ref, output_ref = ref_step(full_x, full_l, full_modules, num_chunks)
    mirror = world * 2 - 1 - rank if v else world - 1 - rank
    local_full_modules = nn.Sequential(full_modules[rank], full_modules[mirror])
    local_modules = nn.Sequential(PipelineStage(hidden_size), PipelineStage(hidden_size))
    local_modules[0].load_state_dict(local_full_modules[0].state_dict())
    local_modules[1].load_state_dict(local_full_modules[1].state_dict())
    model = (DualPipeV if v else DualPipe)(local_modules)

    if v:
        x, l = (full_x, full_l) if is_first_rank else (None, None)
        want_loss, want_out = (loss_ref, output_ref) if is_first_rank else (None, None)
    elif is_first_rank:
        x, l = full_x.chunk(2)[0], full_l.chunk(2)[1]
        want_loss, want_out = loss_ref.chunk(2)[1], output_ref.chunk(2)[1]
    elif is_last_rank:
        x, l = full_x.chunk(2)[1], full_l.chunk(2)[0]
        want_loss, want_out = loss_ref.chunk(2)[0], output_ref.chunk(2)[0]
    else:
        x = l = want_loss = want_out = None

    loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(l,), return_outputs=False)
    records = {
        "loss": {"loss": loss, "reference_loss": want_loss},
        "outputs": {"outputs_returned": outputs is not None},
    }
    if not v:
        # The example's all_gather_into_tensor, as a list all_gather (gloo's takes other shapes).
        for p0, p1 in zip(local_modules[0].parameters(), local_modules[1].parameters()):
            p0all = [torch.empty_like(p0) for _ in range(world)]
            p1all = [torch.empty_like(p1) for _ in range(world)]
            dist.all_gather(p0all, p0.grad)
            dist.all_gather(p1all, p1.grad)
            p0.grad += p1all[world - 1 - rank]
            p1.grad += p0all[world - 1 - rank]
    diffs = [cal_diff(p.grad, p_ref.grad) for p, p_ref in zip(local_modules.parameters(), local_full_modules.parameters())]
    records["grads"] = {"worst_grad_diff": max(diffs)}
    model.zero_grad()
    with torch.no_grad():
        loss, outputs = model.step(x, num_chunks=num_chunks, criterion=criterion, labels=(l,), return_outputs=True)
    records["inference"] = {"loss": loss, "reference_loss": want_loss, "outputs": outputs,
                            "reference_outputs": want_out}
    return records


# -- failures ---------------------------------------------------------------------------------------------


class FailingBlock(Block):
    """Raises in its ``fail_at``-th forward (counting from 1)."""

    def __init__(self, hidden: int, fail_at: int) -> None:
        super().__init__(hidden)
        self.fail_at = fail_at
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards == self.fail_at:
            raise RuntimeError("injected failure")
        return super().forward(x)


def failing_step(
    rank: int, world: int, failing_rank: int, timeout: float, block: type[FailingBlock] = FailingBlock
) -> dict[str, Any]:
    """A DualPipeV step in which ``failing_rank`` fails in its 3rd forward (``block`` says how)."""
    from dualpipe_megatron.runtime import Pipeline

    m = 2 * world
    torch.manual_seed(SEED)
    modules = [block(HIDDEN, 3 if rank == failing_rank else 0) for _ in range(2)]
    (x,), y = batch(m * MICRO_ROWS, torch.float32)
    pipe = Pipeline(
        modules, "dualpipev", p2p_shapes=[(MICRO_ROWS, HIDDEN)], p2p_dtype=torch.float32, timeout=timeout,
    )
    start = time.monotonic()
    try:
        pipe.step(x, num_microbatches=m, criterion=SumSquares(x.shape[0]), labels=[y])
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        outcome = {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    else:
        outcome = {"error": None, "elapsed": time.monotonic() - start}
    if rank == failing_rank:
        # Stay connected for a while, so the peers see a silent rank rather than a closed socket.
        time.sleep(timeout + 2)
    return outcome


def disagreeing_plans(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 runs DualPipeV with its first two stage-0 forwards swapped (a valid schedule), rank 1
    DeepSeek's order: both must raise PlanMismatchError before any pipeline message."""
    from dualpipe_megatron.runtime import Pipeline, PlanMismatchError
    from dualpipe_megatron.schedules import build_schedule, validate

    sched = build_schedule("dualpipev", world, 2 * world)
    if rank == 0:
        ops = sched.ops[0]
        first, second = [i for i, op in enumerate(ops) if str(op).startswith("F(d=0,s=0,")][:2]
        ops[first], ops[second] = ops[second], ops[first]
        validate(sched)
    torch.manual_seed(SEED)
    layers = build_layers(sched.stages, torch.float64)
    (x,), y = batch(sched.microbatches * MICRO_ROWS, torch.float64)
    pipe = Pipeline([layers[s] for s in layers_of(sched, rank)], sched, p2p_shapes=[(MICRO_ROWS, HIDDEN)],
                    p2p_dtype=torch.float64, timeout=3.0)
    try:
        pipe.step(*([x] if rank == 0 else []), criterion=SumSquares(x.shape[0]), labels=[y] if rank == 0 else [])
    except PlanMismatchError as exc:
        return {"error": str(exc), "executed": pipe.stats.peak}
    return {"error": None}


def mismatched_plans(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 believes rank 0 sends micro-batch 1 before 0; with the plan-agreement check taken
    out (it refuses such plans before any message), the debug check must still catch it."""
    from dualpipe_megatron.runtime import Pipeline, PipelineCommError, pipeline
    from dualpipe_megatron.schedules import build_schedule

    pipeline.check_plan_agreement = lambda *args: None  # this process only: it exits after the case
    sched = build_schedule("1f1b", world, 2)
    if rank == 1:
        first = sched.ops[0]
        first[0], first[1] = first[1], first[0]
    torch.manual_seed(SEED)
    (x,), y = batch(2 * MICRO_ROWS, torch.float64)
    pipe = Pipeline(
        [Block(HIDDEN).double()], sched, p2p_shapes=[(MICRO_ROWS, HIDDEN)], p2p_dtype=torch.float64,
        timeout=3.0, debug=True,
    )
    try:
        pipe.step(*([x] if rank == 0 else []), criterion=SumSquares(x.shape[0]), labels=[y] if rank == world - 1 else [])
    except PipelineCommError as exc:
        return {"error": str(exc)}
    return {"error": None}


def shared_search(rank: int, world: int) -> dict[str, Any]:
    """The ranks share the op-order search (DualPipeV, M = 4P, F&B 0.8 of F+B, K = 4 below
    DeepSeek's peak of 2P+1, little work): the order equals one process's; ranks with other
    inputs (rank 1), and a piece that raises on one rank (task P+1, on rank 1), raise on every
    rank instead of leaving the others waiting; objects of different lengths gather whole."""
    from dualpipe_megatron.runtime import PlanMismatchError
    from dualpipe_megatron.runtime.shared_search import RankWorkers, SearchFailedError, all_gather_pickled
    from dualpipe_megatron.schedules import Costs, build_schedule
    from dualpipe_megatron.schedules.optimize import optimize_order

    group = dist.group.WORLD
    sched = build_schedule("dualpipev", world, 4 * world)
    costs = Costs.of(1, 2, "0.5", "2.4")
    shared = optimize_order(sched, costs, max_activations=4, work=20_000,
                            workers=RankWorkers(group, {"costs": repr(costs)}))
    alone = optimize_order(sched, costs, max_activations=4, work=20_000)
    out: dict[str, Any] = {"same": shared.ops == alone.ops, "reordered": shared.ops != sched.ops}
    try:
        RankWorkers(group, {"costs": repr(costs), "budget": str(4 + (rank == 1))})
    except PlanMismatchError as exc:
        out["mismatch"] = str(exc)
    try:
        RankWorkers(group, {}).map(lambda task: 1 // (task - world - 1), list(range(2 * world)))
    except SearchFailedError as exc:
        out["failed"] = str(exc)
    out["merged"] = RankWorkers(group, {}).map(lambda task: (task, rank), list(range(5)))
    out["gathered"] = all_gather_pickled("x" * 1000 * rank, group)  # lengths differ, rank 0's is the shortest
    return out


class KillingBlock(FailingBlock):
    """SIGKILLs its own process in its ``fail_at``-th forward: no exception, no cleanup, no result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forwards + 1 == self.fail_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)
