"""Our DualPipe/DualPipeV forward_backward_func on Megatron GPTModel (CPU, gloo, real processes).

One launch per pipeline size runs every check (importing Megatron costs seconds per process):
losses and every gradient against Megatron's own 1F1B at the same P and against PP=1, for
tied and untied embeddings and M in {2P, 3P} (3P at P=2 only); DualPipeV under an activation
budget; forward-only; checkpoint keys; mirrored copies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import assert_verdict, run_script
from megatron_dualpipe_workers import M_FACTORS

WORKER = Path(__file__).with_name("megatron_dualpipe_workers.py")
TIMEOUT_S = 900


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    pp = request.param
    return pp, run_script(WORKER, pp, tmp_path_factory.mktemp(f"dualpipe_p{pp}"), TIMEOUT_S)


def _check(results: tuple[int, dict], name: str) -> None:
    pp, verdicts = results
    assert_verdict(verdicts, name.format(pp=pp))


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("tied", ["untied", "tied"])
@pytest.mark.parametrize("reference", ["pp1", "1f1b"])
def test_training_step_matches(results: tuple[int, dict], schedule: str, tied: str, reference: str) -> None:
    pp = results[0]
    for factor in M_FACTORS[pp]:
        _check(results, f"{schedule}_vs_{reference}_p{pp}_m{factor * pp}_{tied}")


def test_activation_budget_matches_1f1b(results: tuple[int, dict]) -> None:
    """DualPipeV with max_activations at 3/4 of DeepSeek's peak (M = 2P): another order, no rank
    above the budget, and 1F1B's losses and grads."""
    pp = results[0]
    _check(results, f"budget_dualpipev_vs_1f1b_p{pp}_m{2 * pp}")


@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_reference_1f1b_matches_pp1(results: tuple[int, dict], tied: str) -> None:
    pp = results[0]
    for factor in M_FACTORS[pp]:
        _check(results, f"1f1b_vs_pp1_p{pp}_m{factor * pp}_{tied}")


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_forward_only_matches_1f1b(results: tuple[int, dict], schedule: str) -> None:
    _check(results, f"{schedule}_forward_only_p{{pp}}")


def test_checkpoint_keys_match_1f1b(results: tuple[int, dict]) -> None:
    _check(results, "dualpipev_checkpoint_keys_p{pp}")


def test_prepare_model_equalises_mirrors(results: tuple[int, dict]) -> None:
    _check(results, "dualpipe_mirrors_p{pp}")


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_ddp_finalize_and_per_token_loss_match_1f1b(results: tuple[int, dict], schedule: str) -> None:
    """Megatron DDP (overlapped reduce, no_sync), finalize_model_grads, per-token loss, tied."""
    _check(results, f"{schedule}_ddp_per_token_p{{pp}}")


@pytest.mark.parametrize("ddp", ["plain", "ddp"])
def test_w_false_backward_defers_linear_weight_grads(results: tuple[int, dict], ddp: str) -> None:
    """Under a w:false B every Megatron linear's .grad/main_grad is untouched; after its W it
    equals the full backward's, bit for bit."""
    _check(results, f"wgrad_split_{ddp}_p{{pp}}")


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_deferral_with_overlapped_grad_reduce_keeps_parameters(results: tuple[int, dict], schedule: str) -> None:
    """3 Adam steps with DDP's overlapped grad reduce: deferral on and off end equal."""
    _check(results, f"wgrad_overlap_reduce_{schedule}_p{{pp}}")


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_fp8_contexts_and_first_microbatch_flags_match_interleaved(results: tuple[int, dict], schedule: str) -> None:
    """Recorded (TE is not installable here): each chunk gets one first-micro-batch flag, then
    whole forwards of its layers under FP8 context; every layer as often as under interleaved."""
    _check(results, f"fp8_sequence_{schedule}_p{{pp}}")


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_composes(results: tuple[int, dict], granularity: str) -> None:
    """DualPipeV with the W split and Megatron's activation recompute equals 1F1B with it."""
    _check(results, f"recompute_{granularity}_dualpipev_p{{pp}}")


def test_out_of_order_forwards_match_1f1b(results: tuple[int, dict]) -> None:
    """Data by key: a stage's forwards out of micro-batch order still read their own data."""
    _check(results, "out_of_order_forwards_dualpipev_p{pp}")


def test_ranks_reading_different_stage_costs_refuse_to_step(results: tuple[int, dict]) -> None:
    _check(results, "plan_mismatch_dualpipev_p{pp}")
