"""Overlapped F&B for MoE models (dualpipe_megatron/megatron/moe_overlap.py).

One launch (4 processes: PP=2 x EP=2, MoE GPT with 4 experts, top-2, alltoall dispatcher, bf16)
runs DualPipeV with the overlap on and off and Megatron's interleaved 1F1B (PP=2, VPP=2) with and
without its own combined-1F1B EP overlap, for M = 4 and 6, and compares losses and every
gradient (Megatron DDP's fp32 main_grad); the worker returns each check's measured values
(moe_overlap_workers.py) and the tests here assert on them. The in-process tests check which
models fall back to F then B.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launcher import run_script

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("moe_overlap_workers.py")
WORLD_SIZE = 4
TIMEOUT_S = 900
# Relative to the largest reference value of each tensor. Same plans, same bf16 kernels: only
# the order in which micro-batch grads are summed into fp32 main_grad differs between schedules.
TOLERANCE = 1e-5
# Overlap off runs each layer as one autograd graph; the plans split it into nodes and add the
# residual grads in another order, in bf16 activations: bf16-level differences.
BF16_TOLERANCE = 3e-2
AGREEMENT = ("losses", "reference_losses", "worst_loss_rel_diff", "worst_grad_rel_diff", "grads_only_run",
             "grads_only_reference")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_script(WORKER, WORLD_SIZE, tmp_path_factory.mktemp("moe_overlap"), TIMEOUT_S)


def _record(results: dict, name: str) -> dict:
    assert name in results, f"{name} missing; have {sorted(results)}"
    return results[name]


def _agreement(record: dict) -> tuple[dict, bool]:
    return {key: record[key] for key in AGREEMENT}, record["nonzero_grads"] > 0


def _matches(m: int, tolerance: float) -> tuple[dict, bool]:
    """A run that matches its reference: M losses on each of the two data-parallel ranks, every
    loss and grad within ``tolerance`` of the reference's, the same parameters, some grad not zero."""
    within = pytest.approx(0.0, abs=tolerance)
    losses = {"dp0": m, "dp1": m}
    return {"losses": losses, "reference_losses": losses, "worst_loss_rel_diff": within,
            "worst_grad_rel_diff": within, "grads_only_run": [], "grads_only_reference": []}, True


@pytest.mark.parametrize("m", [4, 6])
def test_overlap_on_equals_megatron_combined_1f1b(results: dict, m: int) -> None:
    """DualPipeV with overlapped F&B vs Megatron's interleaved 1F1B with its EP overlap."""
    record = _record(results, f"overlap_on_vs_megatron_combined_1f1b_m{m}")
    assert _agreement(record) == _matches(m, TOLERANCE), record


@pytest.mark.parametrize("m", [4, 6])
def test_overlap_off_equals_megatron_1f1b(results: dict, m: int) -> None:
    record = _record(results, f"overlap_off_vs_megatron_1f1b_m{m}")
    assert _agreement(record) == _matches(m, TOLERANCE), record


@pytest.mark.parametrize("m", [4, 6])
def test_overlap_on_equals_off(results: dict, m: int) -> None:
    record = _record(results, f"overlap_on_vs_off_m{m}")
    assert _agreement(record) == _matches(m, BF16_TOLERANCE), record


@pytest.mark.parametrize("m", [4, 6])
def test_megatron_references_agree(results: dict, m: int) -> None:
    record = _record(results, f"megatron_combined_vs_plain_1f1b_m{m}")
    assert _agreement(record) == _matches(m, BF16_TOLERANCE), record


@pytest.mark.parametrize("m", [4, 6])
def test_fb_ops_ran_overlapped_only_when_on(results: dict, m: int) -> None:
    """With the overlap on some rank ran overlapped F&B ops; with it off no rank built a plan."""
    record = _record(results, f"overlap_ran_m{m}")
    assert (sum(record["overlapped_fb_ops_per_rank"]) > 0, record["plan_built_ops_overlap_off_per_rank"]) == (
        True, [0] * WORLD_SIZE), record


@pytest.mark.parametrize("reference", ["megatron_combined_1f1b", "without"])
def test_delayed_wgrad_matches(results: dict, reference: str) -> None:
    """``delay_wgrad_compute`` (Megatron's TE delayed wgrad; the slots' backward_dw is a no-op on
    these local layers) equals Megatron's combined 1F1B with it, and our run without it bit for bit."""
    record = _record(results, f"delayed_wgrad_vs_{reference}_m4")
    assert _agreement(record) == _matches(4, TOLERANCE if reference == "megatron_combined_1f1b" else 0.0), record


def test_delayed_wgrad_slots_move_to_w(results: dict) -> None:
    """Every rank's W ops ran more weight-grad closures with delayed wgrad than without: the plan
    slots' backward_dw moved to W."""
    record = _record(results, "delayed_wgrad_slots_deferred")
    assert [delayed > without for delayed, without in record["deferred_closures_with_without_per_rank"]] == (
        [True] * WORLD_SIZE), record


class _Plannable(torch.nn.Module):
    def build_schedule_plan(self, *args, **kwargs):  # pragma: no cover - never called
        raise AssertionError


def _forward_step(data_iterator, model, return_schedule_plan=False):  # pragma: no cover
    raise AssertionError


def _config(**kwargs):
    from types import SimpleNamespace

    base = dict(num_moe_experts=4, expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                recompute_granularity=None, recompute_method=None, recompute_modules=[],
                moe_shared_expert_overlap=False)
    return SimpleNamespace(**(base | kwargs))


@pytest.mark.parametrize("change, reason", [
    (dict(num_moe_experts=None), "dense model"),
    (dict(expert_model_parallel_size=1), "expert-model-parallel size 1"),
    (dict(moe_token_dispatcher_type="allgather"), "token dispatcher 'allgather'"),
    (dict(recompute_granularity="full"), "full activation recomputation"),
    (dict(num_layers=3, moe_layer_freq=[1, 1, 0]), "dense last layer 3"),
    (dict(num_layers=4, moe_layer_freq=2), "dense last layer 4"),
])
def test_models_that_fall_back_to_f_then_b(change: dict, reason: str) -> None:
    from dualpipe_megatron.megatron.moe_overlap import overlap_enabled
    from dualpipe_megatron.megatron.refusals import overlap_blockers

    config = _config(**change)
    assert any(reason in r for r in overlap_blockers(config, [_Plannable()], _forward_step))
    with pytest.warns(UserWarning) if config.num_moe_experts else _no_warning():
        assert not overlap_enabled(True, config, [_Plannable()], _forward_step, forward_only=False)


def _no_warning():
    import contextlib

    return contextlib.nullcontext()


def test_overlap_needs_forward_step_with_schedule_plans_and_plannable_chunks() -> None:
    from dualpipe_megatron.megatron.moe_overlap import overlap_enabled
    from dualpipe_megatron.megatron.refusals import overlap_blockers

    config = _config()
    assert overlap_blockers(config, [_Plannable()], _forward_step) == []
    assert overlap_enabled(True, config, [_Plannable()], _forward_step, forward_only=False)
    assert not overlap_enabled(False, config, [_Plannable()], _forward_step, forward_only=False)  # the flag
    assert not overlap_enabled(True, config, [_Plannable()], _forward_step, forward_only=True)  # eval
    assert any("return_schedule_plan" in r
               for r in overlap_blockers(config, [_Plannable()], lambda it, model: None))
    assert any("build_schedule_plan" in r for r in overlap_blockers(config, [torch.nn.Linear(1, 1)], _forward_step))


def test_a_forward_step_refusing_plans_says_which_flag_to_pass() -> None:
    """Megatron-LM's pretrain_gpt.py asserts --overlap-moe-expert-parallel-comm when asked for a
    schedule plan: the overlap turns that into an error naming the flags; other assertions stay."""
    from dualpipe_megatron.megatron.moe_overlap import asking_for_plans

    def refusing(*_: object, return_schedule_plan: bool = False) -> None:
        assert not return_schedule_plan, "overlap_moe_expert_parallel_comm must be enabled to return the schedule plan"

    def failing(*_: object, **__: object) -> None:
        assert False, "something else"

    assert asking_for_plans(refusing)(None, None) is None
    with pytest.raises(RuntimeError, match="--overlap-moe-expert-parallel-comm .*--no-dualpipe-moe-overlap"):
        asking_for_plans(refusing)(None, None, return_schedule_plan=True)
    with pytest.raises(AssertionError, match="something else"):
        asking_for_plans(failing)()
