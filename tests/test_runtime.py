"""The pipeline runtime on real processes (CPU, gloo): every schedule matches one process.

Each world size is launched once and runs every case in turn (see
``runtime_workers``); the tests below compare each case with a single-process
run of the whole model on the whole batch. The loss is the squared error summed
over rows and divided by the whole batch's rows, so micro-batch losses add up
to the batch loss and micro-batch gradients to the batch gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import runtime_workers as rw
from launcher import spawn
from dualpipe_megatron.runtime.plan import ACT, MessagePlan
from dualpipe_megatron.schedules import Costs, W, build_schedule, simulate

pytestmark = pytest.mark.multiprocess

WORLDS = (2, 4)


def cases(world: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in (2 * world, 2 * world + 1, 3 * world):
        for defer in (True, False):
            for hook in (False, True):
                out.append(dict(schedule="dualpipev", microbatches=m, defer=defer, hook=hook, dtype="float64", debug=hook))
    for m in (2 * world, 3 * world):
        for defer in (True, False):
            for hook in (False, True):
                out.append(dict(schedule="dualpipe", microbatches=m, defer=defer, hook=hook, dtype="float64", debug=hook))
    out += [
        dict(schedule="dualpipev", microbatches=2 * world + 1, defer=True, hook=True, dtype="float32"),
        dict(schedule="dualpipe", microbatches=2 * world, defer=True, hook=False, dtype="float32"),
        dict(schedule="1f1b", microbatches=2 * world, defer=True, hook=False, dtype="float64", debug=True),
        dict(schedule="zb1p", microbatches=2 * world, defer=True, hook=False, dtype="float64"),
        dict(schedule="zb1p", microbatches=2 * world, defer=False, hook=False, dtype="float64"),
        dict(schedule="interleaved", microbatches=2 * world, chunks=2, defer=True, hook=False, dtype="float64"),
        dict(schedule="interleaved", microbatches=world, chunks=2, defer=True, hook=False, dtype="float32"),
        # Two tensors on every edge.
        dict(schedule="dualpipev", microbatches=2 * world + 1, defer=True, hook=False, dtype="float64", pair=True),
        dict(schedule="dualpipe", microbatches=2 * world, defer=True, hook=False, dtype="float64", pair=True),
        dict(schedule="interleaved", microbatches=2 * world, chunks=2, defer=True, hook=False, dtype="float64",
             pair=True, debug=True),
        # Pipeline ranks opposite to group ranks.
        dict(schedule="dualpipev", microbatches=2 * world, defer=True, hook=True, dtype="float64", reversed=True,
             debug=True),
        dict(schedule="dualpipe", microbatches=2 * world, defer=True, hook=False, dtype="float64", reversed=True),
    ]
    for case in out:
        flags = [f for f in ("defer", "hook", "pair", "reversed") if case.get(f)]
        case["id"] = "-".join([case["schedule"], f"M{case['microbatches']}", case["dtype"], *flags])
    out += [dict(schedule="compat", variant=v, id=f"compat-{v}") for v in ("dualpipev", "dualpipe")]
    return out


@functools.cache
def launched(world: int) -> list[dict[str, Any]]:
    return spawn(world, rw.run_cases, cases(world))


def pipeline_cases() -> list[Any]:
    return [
        pytest.param(world, case, id=f"P{world}-{case['id']}")
        for world in WORLDS for case in cases(world) if case["schedule"] != "compat"
    ]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str) -> None:
    tol = 1e-6 if dtype == "float32" else 1e-12
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def by_pp_rank(world: int, case_id: str) -> list[dict[str, Any]]:
    """Each rank's result for a case, indexed by pipeline rank (not group rank)."""
    results = [r[case_id] for r in launched(world)]
    return sorted(results, key=lambda r: r["pp_rank"])


def as_tensors(outputs: Any) -> list[torch.Tensor]:
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


@pytest.mark.parametrize("world, case", pipeline_cases())
def test_step_matches_single_process(world: int, case: dict[str, Any]) -> None:
    per_rank = by_pp_rank(world, case["id"])
    dtype = getattr(torch, case["dtype"])
    pair = case.get("pair", False)
    sched = build_schedule(case["schedule"], world, case["microbatches"], chunks=case.get("chunks"))
    layers = rw.build_layers(sched.stages, dtype, pair=pair)
    xs, y = rw.batch(case["microbatches"] * rw.MICRO_ROWS, dtype, pair)
    ref = rw.reference(layers, xs, y)
    per_dir = y.shape[0] // sched.directions

    total = 0.0
    for d in range(sched.directions):
        got = per_rank[sched.rank_of(d, sched.stages - 1)]
        rows = slice(d * per_dir, (d + 1) * per_dir)
        assert got["loss"].shape == (sched.microbatches_per_direction,)
        total = total + got["loss"].sum()
        for key in ("outputs", "outputs_fo"):
            for i, (o, want) in enumerate(zip(as_tensors(got[key]), ref["outputs"], strict=True)):
                assert_close(o, want[rows], case["dtype"], f"{key}[{i}] of direction {d}")
        assert torch.equal(got["loss_fo"], got["loss"]), "forward-only losses differ from the training step's"
    assert_close(torch.as_tensor(total), ref["loss"], case["dtype"], "loss")

    for rank, got in enumerate(per_rank):
        if all(sched.rank_of(d, sched.stages - 1) != rank for d in range(sched.directions)):
            assert got["loss"] is None and got["outputs"] is None
        assert got["untouched_by_forward_only"], f"rank {rank}: a forward-only step produced grads"
        for module_grads, layer in zip(got["grads"], rw.layers_of(sched, rank), strict=True):
            for i, (g, want) in enumerate(zip(module_grads, ref["grads"][layer], strict=True)):
                assert_close(g, want, case["dtype"], f"rank {rank} layer {layer} param {i} grad")
    if case["hook"]:
        assert sum(r["hook_calls"] for r in per_rank) > 0, "overlapped_forward_backward never called"


@pytest.mark.parametrize("world, case", pipeline_cases())
def test_sent_activations_freed_and_weight_grads_deferred(world: int, case: dict[str, Any]) -> None:
    sched = build_schedule(case["schedule"], world, case["microbatches"], chunks=case.get("chunks"))
    per_rank = by_pp_rank(world, case["id"])
    for rank, got in enumerate(per_rank):
        plan = MessagePlan.build(sched, rank, forward_only=False)
        per_message = 2 if case.get("pair") else 1
        sent = per_message * sum(msg.kind == ACT for per_op in plan.sends for items in per_op for msg, _ in items)
        assert got["freed"] == sent, f"rank {rank}: freed {got['freed']} of {sent} sent activations"
    has_w = any(isinstance(op, W) for ops in sched.ops for op in ops)
    deferred = sum(r["deferred"] for r in per_rank)
    assert (deferred > 0) == (case["defer"] and has_w), f"{deferred} deferred weight-grad closures ran"


@pytest.mark.parametrize(
    "world, case", [p for p in pipeline_cases() if p.values[1]["defer"]]
)
def test_peak_activations_match_simulator(world: int, case: dict[str, Any]) -> None:
    sched = build_schedule(case["schedule"], world, case["microbatches"], chunks=case.get("chunks"))
    sim = simulate(sched, Costs.of())
    got = [r["peak"] for r in by_pp_rank(world, case["id"])]
    assert got == [s.peak_activations for s in sim.per_rank]


def example_records(world: int, variant: str, check: str) -> list[dict[str, Any]]:
    """Every rank's record of one check of DeepSeek's example, in rank order."""
    return [result[f"compat-{variant}"][check] for result in launched(world)]


def same(got: torch.Tensor | None, want: torch.Tensor | None) -> bool:
    """Both absent (a rank without the example's losses or outputs), or bit for bit equal."""
    return got is None and want is None or got is not None and want is not None and torch.equal(got, want)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["dualpipev", "dualpipe"])
def test_reference_example_training_loss(world: int, variant: str) -> None:
    records = example_records(world, variant, "loss")
    assert [same(r["loss"], r["reference_loss"]) for r in records] == [True] * world, records


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["dualpipev", "dualpipe"])
def test_reference_example_returns_no_outputs_unasked(world: int, variant: str) -> None:
    records = example_records(world, variant, "outputs")
    assert [r["outputs_returned"] for r in records] == [False] * world, records


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["dualpipev", "dualpipe"])
def test_reference_example_grads(world: int, variant: str) -> None:
    """The example's own measure: 1 - cosine-like similarity with the reference, below 1e-13."""
    records = example_records(world, variant, "grads")
    assert [r["worst_grad_diff"] < 1e-13 for r in records] == [True] * world, records


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("variant", ["dualpipev", "dualpipe"])
def test_reference_example_forward_only(world: int, variant: str) -> None:
    records = example_records(world, variant, "inference")
    assert [(same(r["loss"], r["reference_loss"]), same(r["outputs"], r["reference_outputs"])) for r in records] == (
        [(True, True)] * world), records


BAD_CALLS = {
    "modules": "module(s) were given",
    "microbatches": "microbatches >= 2*ranks",
    "inputs": "needs its inputs",
    "criterion": "needs a criterion",
    "split": "does not split into",
    "shapes": "declare p2p_shapes",
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_calls_fail_before_communicating(world: int, name: str) -> None:
    messages = launched(world)[0]["bad_calls"]
    assert BAD_CALLS[name] in messages[name], f"{name}: {messages[name]!r}"


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_share_the_op_order_search(world: int) -> None:
    """runtime/shared_search.py: each rank runs its pieces, every rank gets every result."""
    for rank, result in enumerate(r["shared_search"] for r in launched(world)):
        assert result["same"] and result["reordered"], (rank, result)
        assert "pipeline ranks [1] would optimize the op order from other inputs than rank 0 (rank 1 differs " \
            "in: budget)" in result["mismatch"], result
        assert "failed on pipeline rank 1: ZeroDivisionError" in result["failed"], result
        assert result["merged"] == [(task, task % world) for task in range(5)], result
        assert result["gathered"] == ["x" * 1000 * r for r in range(world)], rank


def _assert_peers_raised(results: list, failed: int, limit: float) -> list[str]:
    """Every rank but ``failed`` raised PipelineCommError naming itself and a peer within ``limit`` s."""
    messages = []
    for rank, got in enumerate(results):
        if rank == failed:
            continue
        assert got["error"] == "PipelineCommError", f"rank {rank}: {got}"
        assert got["elapsed"] <= limit, f"rank {rank} took {got['elapsed']:.1f}s"
        assert f"pipeline rank {rank}:" in got["message"] and "peer rank" in got["message"], got["message"]
        messages.append(got["message"])
    return messages


def test_failed_rank_makes_every_other_rank_raise() -> None:
    timeout = 3.0
    results = spawn(4, rw.failing_step, 1, timeout, timeout=timeout + 60)
    assert results[1]["error"] == "RuntimeError" and "injected failure" in results[1]["message"]
    for message in _assert_peers_raised(results, 1, timeout + 30):
        assert "op #" in message and "micro-batch" in message, message


def test_ranks_with_different_plans_refuse_to_step() -> None:
    results = spawn(2, rw.disagreeing_plans, timeout=60)
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} stepped with a plan rank 1 does not share"
        assert "ranks [1] differ from rank 0" in result["error"], result
        assert "pipeline rank 0's op 0: F(d=0,s=0,m=1) vs F(d=0,s=0,m=0)" in result["error"], result
        assert result["executed"] == 0, f"rank {rank} ran ops before refusing"


def test_debug_check_catches_mismatched_messages() -> None:
    results = spawn(2, rw.mismatched_plans, timeout=60)
    assert "message mismatch from rank 0" in results[1]["error"], results[1]
    assert "expected activation of F(d=0,s=0,m=0)" in results[1]["error"]
    assert results[0]["error"] is not None


def test_killed_rank_makes_every_other_rank_raise() -> None:
    """A rank SIGKILLed mid-step (no exception, no goodbye): every peer raises, naming a peer."""
    timeout = 4.0
    results = spawn(4, rw.failing_step, 1, timeout, rw.KillingBlock, timeout=timeout + 50, may_vanish={1})
    assert results[1] is None, f"the killed rank reported {results[1]}"
    _assert_peers_raised(results, 1, timeout + 20)
