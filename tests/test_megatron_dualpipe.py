"""Our DualPipe/DualPipeV forward_backward_func on Megatron GPTModel (CPU, gloo, real processes).

One launch per pipeline size runs every check (importing Megatron costs seconds per process):
losses and every gradient against Megatron's own 1F1B at the same P and against PP=1, for
tied and untied embeddings and M in {2P, 3P} (3P at P=2 only); DualPipeV under an activation
budget; forward-only; checkpoint keys; mirrored copies. The worker returns each check's measured
values (megatron_dualpipe_workers.py); every test here asserts on them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher import run_script
from megatron_dualpipe_workers import M_FACTORS, TOLERANCE

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("megatron_dualpipe_workers.py")
TIMEOUT_S = 900
AGREEMENT = ("losses_per_rank", "reference_losses", "worst_loss_rel_diff", "worst_grad_rel_diff",
             "missing_parameters")


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    pp = request.param
    return pp, run_script(WORKER, pp, tmp_path_factory.mktemp(f"dualpipe_p{pp}"), TIMEOUT_S)


def _record(results: tuple[int, dict], name: str) -> dict:
    """One check's measured values; ``{pp}`` in ``name`` is the pipeline size."""
    pp, records = results
    key = name.format(pp=pp)
    assert key in records, f"{key} missing; have {sorted(records)}"
    return records[key]


def _agreement(record: dict) -> dict:
    return {key: record[key] for key in AGREEMENT}


def _matches(pp: int, m: int) -> dict:
    """A run that matches its reference: M losses, all on the last rank, every loss and grad
    within TOLERANCE of the reference's, and every reference parameter on some rank."""
    within = pytest.approx(0.0, abs=TOLERANCE)
    return {"losses_per_rank": [0] * (pp - 1) + [m], "reference_losses": m, "worst_loss_rel_diff": within,
            "worst_grad_rel_diff": within, "missing_parameters": []}


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
@pytest.mark.parametrize("tied", ["untied", "tied"])
@pytest.mark.parametrize("reference", ["pp1", "1f1b"])
def test_training_step_matches(results: tuple[int, dict], schedule: str, tied: str, reference: str) -> None:
    pp = results[0]
    for m in (factor * pp for factor in M_FACTORS[pp]):
        record = _record(results, f"{schedule}_vs_{reference}_p{pp}_m{m}_{tied}")
        assert _agreement(record) == _matches(pp, m), f"M={m}"


def test_activation_budget_matches_1f1b(results: tuple[int, dict]) -> None:
    """DualPipeV with max_activations at 3/4 of DeepSeek's peak (M = 2P): another order (the one
    a single process finds), no rank above the budget, and 1F1B's losses and grads."""
    pp = results[0]
    record = _record(results, f"budget_dualpipev_vs_1f1b_p{pp}_m{2 * pp}")
    budget, peaks = record["budget"], record["peaks_run"]
    assert (_agreement(record), record["deepseek_peak"] > budget, max(max(p) for p in peaks) <= budget,
            record["order_differs_from_deepseek"], record["order_is_one_process_order"]) == (
        _matches(pp, 2 * pp), True, True, [True] * pp, [True] * pp), record


@pytest.mark.parametrize("tied", ["untied", "tied"])
def test_reference_1f1b_matches_pp1(results: tuple[int, dict], tied: str) -> None:
    pp = results[0]
    for m in (factor * pp for factor in M_FACTORS[pp]):
        assert _agreement(_record(results, f"1f1b_vs_pp1_p{pp}_m{m}_{tied}")) == _matches(pp, m), f"M={m}"


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_forward_only_matches_1f1b(results: tuple[int, dict], schedule: str) -> None:
    pp = results[0]
    assert _agreement(_record(results, f"{schedule}_forward_only_p{pp}")) == _matches(pp, 2 * pp)


def test_checkpoint_keys_match_1f1b(results: tuple[int, dict]) -> None:
    pp = results[0]
    record = _record(results, "dualpipev_checkpoint_keys_p{pp}")
    assert (record["layer_numbers"], record["keys_only_ours"], record["keys_only_1f1b"]) == (
        list(range(1, 2 * pp + 1)), [], []), record


def test_prepare_model_equalises_mirrors(results: tuple[int, dict]) -> None:
    """Direction-1 copies moved by 1.0 differ before prepare_model, equal after, marked shared."""
    pp = results[0]
    record = _record(results, "dualpipe_mirrors_p{pp}")
    assert (min(record["copy_difference_before"]) > 0.5, record["copy_difference_after"],
            record["direction1_marked_shared"]) == (True, [0.0] * pp, [True] * pp), record


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_ddp_finalize_and_per_token_loss_match_1f1b(results: tuple[int, dict], schedule: str) -> None:
    """Megatron DDP (overlapped reduce, no_sync), finalize_model_grads, per-token loss, tied."""
    pp = results[0]
    assert _agreement(_record(results, f"{schedule}_ddp_per_token_p{pp}")) == _matches(pp, 2 * pp)


@pytest.mark.parametrize("ddp", ["plain", "ddp"])
def test_w_false_backward_defers_linear_weight_grads(results: tuple[int, dict], ddp: str) -> None:
    """Under a w:false B every Megatron linear's .grad/main_grad is untouched; after its W it
    equals the full backward's, bit for bit."""
    pp = results[0]
    record = _record(results, f"wgrad_split_{ddp}_p{pp}")
    assert (min(record["linear_weights"]) > 0, record["untouched_by_w_false_backward"],
            record["differ_from_full_backward_after_w"]) == (True, [True] * pp, [[]] * pp), record


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_deferral_with_overlapped_grad_reduce_keeps_parameters(results: tuple[int, dict], schedule: str) -> None:
    """3 Adam steps with DDP's overlapped grad reduce: deferral on and off end equal."""
    pp = results[0]
    record = _record(results, f"wgrad_overlap_reduce_{schedule}_p{pp}")
    assert (min(record["deferred_closures_on"]) > 0, record["deferred_closures_off"],
            record["worst_parameter_rel_diff"]) == (True, [0] * pp, pytest.approx(0.0, abs=TOLERANCE)), record


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_fp8_contexts_and_first_microbatch_flags_match_interleaved(results: tuple[int, dict], schedule: str) -> None:
    """Recorded (TE is not installable here): each chunk gets one first-micro-batch flag, then
    whole forwards of its layers under FP8 context; every layer as often as under interleaved."""
    pp = results[0]
    record = _record(results, f"fp8_sequence_{schedule}_p{pp}")
    every_layer_m_times = [[layer, 2 * pp] for layer in range(2 * pp)]
    assert (record["chunks_out_of_sequence"], record["interleaved_chunks_out_of_sequence"],
            record["forwards_per_layer"], record["interleaved_forwards_per_layer"]) == (
        [], [], every_layer_m_times, every_layer_m_times), record


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_composes(results: tuple[int, dict], granularity: str) -> None:
    """DualPipeV with the W split and Megatron's activation recompute equals 1F1B with it."""
    pp = results[0]
    record = _record(results, f"recompute_{granularity}_dualpipev_p{pp}")
    assert (_agreement(record), min(record["deferred_closures"]) > 0) == (_matches(pp, 2 * pp), True), record


def test_out_of_order_forwards_match_1f1b(results: tuple[int, dict]) -> None:
    """Data by key: a stage's forwards out of micro-batch order still read their own data."""
    pp = results[0]
    assert _agreement(_record(results, f"out_of_order_forwards_dualpipev_p{pp}")) == _matches(pp, 2 * pp)


def test_ranks_reading_different_stage_costs_refuse_to_step(results: tuple[int, dict]) -> None:
    """The two cost files give different orders; every rank raises PlanMismatchError naming the
    costs, and no rank ran an op."""
    pp = results[0]
    record = _record(results, "plan_mismatch_dualpipev_p{pp}")
    named = ["from other inputs than rank 0 (rank 1 differs in: costs)" in e for e in record["error"]]
    assert (record["orders_differ"], named, record["stats_of_ops_run"]) == (
        [True] * pp, [True] * pp, [None] * pp), record
