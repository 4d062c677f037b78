"""Megatron-Core's own schedules, MoE and optimizer on CPU/gloo through the CPU-compat layer.

One launch of two rank processes (tests/megatron_workers.py) runs every layout; the worker
returns each check's measured values and every test here asserts on them. A failing or hanging
rank fails every check with its log.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpipe_megatron.megatron.cpu_compat import GROUPS

from launcher import run_script

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("megatron_workers.py")
WORLD_SIZE = 2
TIMEOUT_S = 240
MICROBATCHES = 4  # megatron_workers.MICROBATCHES: the losses of one step
MOE_TOLERANCE = 1e-7  # absolute, on every loss and grad: EP=2 sums expert tokens in another order
OPTIMIZER_TOLERANCE = 1e-7  # absolute, on every parameter after the step
NORM_TOLERANCE = 1e-6  # relative, on the clipped step's total grad norm


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    return run_script(WORKER, WORLD_SIZE, tmp_path_factory.mktemp("megatron_cpu"), TIMEOUT_S)


def _record(results: dict[str, dict[str, object]], name: str) -> dict:
    assert name in results, f"{name} missing; have {sorted(results)}"
    return results[name]


def _agreement(record: dict) -> dict:
    """What a comparison with its reference must show, whatever the layout."""
    return {key: record[key] for key in ("losses_per_rank", "reference_losses_per_rank", "worst_loss_abs_diff",
                                         "worst_grad_abs_diff", "missing_parameters")}


def test_all_groups_installed_in_workers(results: dict[str, dict[str, object]]) -> None:
    record = _record(results, "installed")
    assert record["groups_per_rank"] == [list(GROUPS)] * WORLD_SIZE, record


def test_rng_tracker_forks_the_cpu_generator(results: dict[str, dict[str, object]]) -> None:
    """Megatron's RNG tracker really forks the (CPU) generator: a fork draws other numbers, the
    default generator resumes where it was, and the next fork goes on from the first."""
    record = _record(results, "rng_fork")
    draws = record["draws_per_rank"]
    assert ([d["after_fork"] == d["plain"] for d in draws], [d["first_fork"] != d["plain"] for d in draws],
            [d["second_fork"] != d["first_fork"] for d in draws]) == ([True] * WORLD_SIZE,) * 3, record


@pytest.mark.parametrize("check", ["pp2_1f1b", "pp2_vpp2"])
def test_pipeline_parallel_matches_pp1_bit_for_bit(results: dict[str, dict[str, object]], check: str) -> None:
    """PP=2 1F1B and PP=2 x VPP=2 interleaved == PP=1: the losses on the last stage, every grad
    bit for bit (and not all zero), every parameter on some rank."""
    record = _record(results, check)
    assert (_agreement(record), min(record["nonzero_grads_per_rank"]) > 0) == (
        {"losses_per_rank": [0, MICROBATCHES], "reference_losses_per_rank": [MICROBATCHES] * WORLD_SIZE,
         "worst_loss_abs_diff": 0.0, "worst_grad_abs_diff": 0.0, "missing_parameters": []}, True), record


def test_moe_expert_parallel_matches_ep1(results: dict[str, dict[str, object]]) -> None:
    """MoE, 4 experts top-2, alltoall dispatcher: EP=2 == EP=1 (each rank its own tokens)."""
    record = _record(results, "moe_ep2")
    within = pytest.approx(0.0, abs=MOE_TOLERANCE)
    assert (_agreement(record), min(record["nonzero_grads_per_rank"]) > 0) == (
        {"losses_per_rank": [MICROBATCHES] * WORLD_SIZE, "reference_losses_per_rank": [MICROBATCHES] * WORLD_SIZE,
         "worst_loss_abs_diff": within, "worst_grad_abs_diff": within, "missing_parameters": []}, True), record


def test_ddp_distributed_optimizer_step_matches_torch_adam(results: dict[str, dict[str, object]]) -> None:
    """DDP with overlapped reduce and the distributed optimizer, one clipped Adam step, against
    torch: the same total grad norm, the same parameters after (which the step moved)."""
    record = _record(results, "ddp_distopt")
    torch_norms = record["torch_grad_norm_per_rank"]
    assert (record["step_succeeded_per_rank"], record["grad_norm_per_rank"], record["worst_param_abs_diff"],
            record["smallest_param_update"] > OPTIMIZER_TOLERANCE) == (
        [True] * WORLD_SIZE, pytest.approx(torch_norms, rel=NORM_TOLERANCE),
        pytest.approx(0.0, abs=OPTIMIZER_TOLERANCE), True), record
