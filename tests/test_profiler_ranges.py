"""Every executed op is a named profiler range, in schedule order, only while a profiler records.

The runtime case runs 2 gloo ranks (``profiler_workers``); the Megatron case runs
``pretrain_gpt.py`` with Megatron's own ``--profile --use-pytorch-profiler`` and
reads the chrome trace it writes for each rank.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

import profiler_workers as pw
from dualpipe_megatron.runtime.plan import executed_halves
from dualpipe_megatron.runtime.profiler_ranges import NAME, PREFIX, op_range, range_name
from dualpipe_megatron.schedules import B, F, FB, Key, Schedule, W, build_schedule
from dualpipe_megatron.schedules.ir import halves
from dualpipe_megatron.trace.kineto import read_profiles
from launcher import LaunchFailed, spawn
from pretrain_runs import TRAIN, losses, run

pytestmark = pytest.mark.multiprocess

WORLD = 2
CASES = [
    dict(id="dualpipev-hook", schedule="dualpipev", microbatches=4 * WORLD, hook=True),
    dict(id="dualpipe", schedule="dualpipe", microbatches=4 * WORLD, hook=False),
]


def expected(sched: Schedule, rank: int, forward_only: bool) -> list[str]:
    """The range names of one step on ``rank``, in its op order."""
    parts = (executed_halves(op, forward_only) for op in sched.ops[rank])
    return [range_name(p) for p in parts if p]


def assert_ranges(ranges: list[tuple[str, float, float]], want: list[str], where: str) -> None:
    names = [name for name, _, _ in ranges]
    assert names == want, f"{where}: ranges differ from the schedule's op order"
    assert all(NAME.fullmatch(name) for name in names), where
    overlapping = [(a[0], b[0]) for a, b in zip(ranges, ranges[1:]) if a[2] > b[1]]
    assert not overlapping, f"{where}: op ranges overlap: {overlapping[:3]}"


def test_range_names() -> None:
    k = Key(1, 2, 3)
    assert range_name((F(k),)) == "dualpipe F d1 s2 m3"
    assert range_name((B(k),)) == "dualpipe B d1 s2 m3"
    assert range_name((B(k, w=False),)) == "dualpipe B d1 s2 m3 w=false"
    assert range_name((W(k),)) == "dualpipe W d1 s2 m3"
    fb = FB(F(Key(0, 1, 4)), B(k, w=False))
    assert range_name(halves(fb)) == "dualpipe FB F(d0 s1 m4) B(d1 s2 m3 w=false)"
    assert NAME.fullmatch(range_name(halves(fb)))["b"] == "d1 s2 m3 w=false"


def test_no_range_without_profiler() -> None:
    """Off, every op gets the same shared no-op context (nothing made per op)."""
    assert op_range((F(Key(0, 0, 0)),)) is op_range(halves(FB(F(Key(0, 1, 1)), B(Key(0, 0, 0)))))


@functools.cache
def launched() -> list[dict[str, Any]]:
    return spawn(WORLD, pw.profiled_steps, CASES)


def per_rank(case: dict[str, Any]) -> list[tuple[int, dict[str, Any], list[str]]]:
    """Each rank's result for ``case`` and the range names its training and forward-only steps should make."""
    sched = build_schedule(case["schedule"], WORLD, case["microbatches"])
    return [
        (rank, results[case["id"]], expected(sched, rank, False) + expected(sched, rank, True))
        for rank, results in enumerate(launched())
    ]


BY_CASE = pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])


@BY_CASE
def test_runtime_step_makes_no_range_with_profiler_off(case: dict[str, Any]) -> None:
    for rank, got, _ in per_rank(case):
        assert got["made_off"] == 0, f"rank {rank}: ranges made with no profiler on"


@BY_CASE
def test_runtime_step_makes_one_range_per_executed_op(case: dict[str, Any]) -> None:
    for rank, got, want in per_rank(case):
        assert got["made_on"] == len(want), f"rank {rank}"


@BY_CASE
def test_runtime_step_ranges_follow_the_op_order(case: dict[str, Any]) -> None:
    for rank, got, want in per_rank(case):
        assert any(name.startswith(f"{PREFIX}FB") for name in want)
        assert_ranges(got["ranges"], want, f"rank {rank}")


@BY_CASE
def test_runtime_step_calls_the_overlap_hook_only_when_set(case: dict[str, Any]) -> None:
    for rank, got, _ in per_rank(case):
        assert (got["hook_calls"] > 0) == case["hook"], f"rank {rank}: overlap hook calls {got['hook_calls']}"


def test_megatron_profiler_trace(tmp_path: Path) -> None:
    """Megatron's PyTorch profiler over iteration 2 of 3: each rank's trace holds that step's ops in order."""
    tensorboard = tmp_path / "tb"
    try:
        log = run("profiled", tmp_path, WORLD, [
            *TRAIN, "--pipeline-model-parallel-size", str(WORLD), "--pipeline-schedule", "dualpipev",
            "--train-iters", "3", "--profile", "--use-pytorch-profiler", "--profile-step-start", "2",
            "--profile-step-end", "3", "--tensorboard-dir", str(tensorboard)])
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    assert sorted(losses(log)) == [1, 2, 3]
    sched = build_schedule("dualpipev", WORLD, 16)  # global batch 16, micro-batch 1, DP 1
    for rank in range(WORLD):
        trace = tensorboard.parent / "torch_profile" / f"rank-{rank}.json.gz"
        assert trace.exists(), f"no trace for rank {rank} in {sorted(tmp_path.rglob('*'))}"
        assert_ranges(pw.trace_ranges(str(trace), PREFIX), expected(sched, rank, False), f"rank {rank}")
    # ``trace profile`` reads the same files end to end: a CPU run, so the ops' host-side times only.
    profiles = read_profiles([tensorboard.parent / "torch_profile"])
    assert [(p.rank, p.gpu) for p in profiles] == [(rank, False) for rank in range(WORLD)]
    for p in profiles:
        ranges = pw.trace_ranges(str(p.path), PREFIX)
        ops = {n: ph for n, ph in p.phases.items() if n.startswith(PREFIX)}
        assert sorted(ops) == sorted(name for name, _, _ in ranges)
        assert all(ph.count == 1 and ph.kind in ("F", "B", "W", "FB") for ph in ops.values())
        assert sum(ph.host_ms for ph in ops.values()) == pytest.approx(sum(e - s for _, s, e in ranges) / 1e3)
