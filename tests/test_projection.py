"""The calibrated projection: cost-model arithmetic, schedule ranking, measurement and CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from dualpipe_megatron.projection import (
    DEEPSEEK_V3, DEEPSEEK_V3_STAGE, PRESETS, Network, OpCosts, StageTimes, a2a_ms, count_chunk, measure,
    megatron_combined_1f1b, p2p_ms, project, schedule_costs, stage_times,
)
from dualpipe_megatron.projection.cli import main
from dualpipe_megatron.projection.comm import a2a_transfer_ms
from dualpipe_megatron.projection.costs import compute_ms, overlapped_fb
from dualpipe_megatron.projection.count import _params
from dualpipe_megatron.projection.placement import FromFile, Realistic, Uniform, megatron_counts
from dualpipe_megatron.projection.project import VARIANTS, build_variant, variants
from dualpipe_megatron.schedules import FB, F, Costs, ScheduleError, build_schedule, simulate
from dualpipe_megatron.schedules.simulate import StageCosts

pytestmark = pytest.mark.multiprocess

TINY = PRESETS["tiny"]


def times(F: float = 1, B: float = 2, W: float = 0.5, FB: float = 3, a2a: float = 0,
          p2p: float = 0) -> StageTimes:
    return StageTimes(F=F, B=B, W=W, FB=FB, a2a_fwd=a2a, a2a_bwd=a2a, p2p=p2p, source="test")


@pytest.fixture(scope="module")
def default_job() -> dict:
    """The default DeepSeek-V3-like job with the built-in costs."""
    chunk = count_chunk(DEEPSEEK_V3_STAGE)
    times = stage_times(DEEPSEEK_V3_STAGE, chunk, None, None, Network())
    results = project(Uniform(times, 0.1, 16), 16, 48)
    return {r.variant.label: r for r in results}


def test_without_communication_it_is_the_simulator_with_the_compute_costs() -> None:
    t = times(F=1, B=2, W=0.5, FB=2.5)
    got = {r.variant.label: r.result.makespan for r in project(Uniform(t, 0.3, 4), 4, 8)}
    for v in VARIANTS:
        sched = build_variant(v, 4, 8)
        costs = Costs.of(1, 2, "0.5", "2.5").scaled(Fraction(4, sched.stages))
        base = simulate(sched, costs).makespan
        assert got[v.label] <= base if v.optimize else got[v.label] == base, v.label


def test_all_to_all_enters_lone_ops_in_full_and_pairs_up_to_their_compute() -> None:
    assert overlapped_fb(10, 4, 0) == 10 and overlapped_fb(10, 4, 0.5) == 12
    assert overlapped_fb(3, 8, 0) == 8  # compute hides only as much as it lasts
    assert overlapped_fb(3, 8, 1) == 11  # loss 1: no overlap at all
    t = times(F=1, B=2, W=0.5, FB=3, a2a=1, p2p=0.25)
    assert schedule_costs(t, overlap=False, loss=0) == Costs.of(2, 3, "0.5", 5, "0.25")
    assert schedule_costs(t, overlap=True, loss=0) == Costs.of(2, 3, "0.5", 3, "0.25")
    assert schedule_costs(times(a2a=2), overlap=True, loss=0).FB == 4
    with pytest.raises(ValueError, match="overlap loss"):
        overlapped_fb(1, 1, 1.5)


def test_communication_arithmetic() -> None:
    token_set = 4096 * 7168 * 2  # one micro-batch's hidden states in bf16
    net = Network()
    assert p2p_ms(DEEPSEEK_V3_STAGE, net) == pytest.approx(token_set / 50e6 + 0.01)
    # 4 of 8 nodes per token, 3.5 of them remote on average; 7 of 8 copies over NVLink.
    inter, intra = token_set * 3.5 / 50e6, token_set * 7 / 160e6
    assert a2a_transfer_ms(DEEPSEEK_V3_STAGE, net) == pytest.approx(max(inter, intra))
    assert a2a_ms(DEEPSEEK_V3_STAGE, net) == pytest.approx(2 * 4 * inter)
    one_node = replace(DEEPSEEK_V3_STAGE, ep=8)
    assert a2a_transfer_ms(one_node, net) == pytest.approx(intra)
    with pytest.raises(ValueError, match="ib_gbps must be positive"):
        Network(ib_gbps=0)


def test_megatron_combined_1f1b_order() -> None:
    plain = build_schedule("interleaved", 4, 8, 2)
    paired = megatron_combined_1f1b(plain)
    simulate(paired, Costs.of())  # valid and deadlock-free
    for before, after in zip(plain.ops, paired.ops):
        warm = next(i for i, op in enumerate(before) if not isinstance(op, F))
        assert all(isinstance(op, F) for op in after[:warm])
        if len(after) > warm:
            pair = after[warm]
            assert isinstance(pair, FB) and pair.f.key != pair.b.key
    with pytest.raises(ScheduleError, match="only F/B schedules"):
        megatron_combined_1f1b(build_schedule("zb1p", 4, 8))


def test_default_job_ranks_schedules_sensibly(default_job: dict) -> None:
    step = {k: r.result.makespan for k, r in default_job.items()}
    bubble = {k: r.result.bubble_ratio for k, r in default_job.items()}
    assert bubble["dualpipev"] < bubble["1f1b"] and bubble["dualpipe"] < bubble["1f1b"]
    assert bubble["zb1p"] < bubble["1f1b"]
    assert step["interleaved-2+a2a"] < step["interleaved-2"] < step["1f1b"]
    assert step["interleaved-4"] < step["interleaved-2"]
    assert step["dualpipev+opt"] <= step["dualpipev"] and step["dualpipe+opt"] <= step["dualpipe"]
    assert max(step["dualpipe"], step["dualpipev"]) < step["zb1p"]
    # Overlap leaves only a fraction of the all-to-all exposed.
    assert default_job["dualpipev"].exposed_a2a_ms < 0.6 * default_job["1f1b"].exposed_a2a_ms
    assert default_job["dualpipe"].result.params_per_rank == 2 * default_job["1f1b"].result.params_per_rank
    params = {k: r.params_stages for k, r in default_job.items()}
    assert params["chimera"] == 2 * params["1f1b"] and params["zbv"] == params["1f1b"] == 1


def test_counts_split_backward_and_scale_with_layers() -> None:
    one, two = count_chunk(TINY), count_chunk(replace(TINY, num_layers=2))
    assert one.B == one.B_input + one.W and 0 < one.W < one.B
    assert (two.F, two.B, two.W, two.saved_bytes, two.params) == (
        2 * one.F, 2 * one.B, 2 * one.W, 2 * one.saved_bytes, 2 * one.params)
    # Two layers built give the parameters count_chunk multiplies out from one.
    assert _params(replace(TINY, num_layers=2), torch.bfloat16) == two.params


def test_compute_ms_scales_by_flops_and_rebases() -> None:
    flops = count_chunk(TINY)
    ms = {"F": 1.0, "B": 2.0, "B_input": 1.5, "W": 0.5, "F_then_B": 3.0}
    measured = OpCosts(TINY, ms, flops, "test", "float32")
    same, _ = compute_ms(flops, measured, None)
    assert same == pytest.approx({"F": 1, "B": 2, "W": 0.5, "FB": 3})
    double, _ = compute_ms(count_chunk(replace(TINY, num_layers=2)), measured, None)
    assert double == pytest.approx({"F": 2, "B": 4, "W": 1, "FB": 6})
    rebased, label = compute_ms(flops, measured, tflops=1e-6)  # 1 kFLOP per ms
    assert rebased["F"] == pytest.approx(flops.F / 1000) and "rebased" in label
    assert rebased["B"] / rebased["F"] == pytest.approx(2)


def test_measure_tiny_gives_positive_costs_and_round_trips(tmp_path: Path) -> None:
    costs = measure(TINY, device="cpu", repeats=3, warmup=1)
    assert all(v > 0 for v in costs.ms.values()) and costs.ms["W"] < costs.ms["B"]
    again = OpCosts.from_json_obj(json.loads(json.dumps(costs.to_json_obj())))
    assert again.ms == costs.ms and again.shape == TINY and again.flops == costs.flops


def test_cli_measure_then_project_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs, out = tmp_path / "costs.json", tmp_path / "proj.json"
    assert main(["measure", "--preset", "tiny", "--repeats", "1", "--warmup", "0",
                 "--threads", "1", "-o", str(costs)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["project", "--op-costs", str(costs), "--tflops", "400", "-P", "4", "-M", "8",
                 "--layers-per-rank", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| dualpipev |" in text and "Assumptions:" in text and "rebased" in text
    doc = json.loads(out.read_text())
    assert set(doc) == {"job", "op_costs", "network", "overlap_loss", "stage_ms", "rows",
                        "assumptions"}
    assert [r["schedule"] for r in doc["rows"]] == [v.label for v in VARIANTS]
    assert doc["rows"][0]["vs_1f1b"] == 1.0
    assert set(doc["rows"][0]) >= {"step_ms", "bubble_ratio", "max_bubble_ms", "exposed_a2a_ms",
                                   "peak_activations_stages", "peak_activations_gib",
                                   "params_per_rank"}


def test_cli_schedule_the_shape_forbids_is_a_row_not_an_error(capsys) -> None:
    assert main(["project", "-P", "3", "-M", "6", "--layers-per-rank", "1"]) == 0
    assert "n/a: dualpipe: dualpipe needs an even number of ranks" in capsys.readouterr().out


@pytest.mark.parametrize("argv,fragment", [
    (["project", "--op-costs", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (["project", "--tflops", "-1"], "expected a positive number, got -1"),
    (["project", "--ib-gbps", "0"], "ib_gbps must be positive"),
    (["project", "--overlap-loss", "2"], "expected a number within [0, 1], got 2"),
    (["project", "--ep", "3"], "experts (256) must divide evenly over ep (3)"),
    (["project", "-M", "x"], "expected an integer, got 'x'"),
    (["measure", "--dtype", "nope", "-o", "x.json"], "unknown dtype 'nope'"),
    (["measure"], "required: -o/--output"),
])
def test_bad_input_is_one_line_and_status_2(argv, fragment, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err


def test_bad_op_cost_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    for text, fragment in [("{", "is not JSON"), ("{}", "not an op-cost file")]:
        bad.write_text(text)
        assert main(["project", "--op-costs", str(bad)]) == 2
        assert fragment in capsys.readouterr().err


def test_module_entry_point_reports_errors_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "dualpipe_megatron.projection", "project",
                           "--tflops", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def test_megatron_split_counts_embedding_and_loss_as_layers() -> None:
    assert megatron_counts(61, 16) == [3] + [4] * 14 + [2]  # E+3 | 4 x 14 | 2+mL
    assert megatron_counts(61, 32) == [1] + [2] * 30 + [0]  # Megatron's DeepSeek-V3 'Et|(tt|)*30mL'
    assert megatron_counts(6, 4) == [1, 2, 2, 1]  # divides: Megatron's own rule
    with pytest.raises(ScheduleError, match="cannot fill 64 stages"):
        megatron_counts(61, 64)


@pytest.fixture(scope="module")
def realistic() -> Realistic:
    target = replace(DEEPSEEK_V3_STAGE, num_layers=4)
    chunk = count_chunk(target)
    times = stage_times(target, chunk, None, None, Network())
    return Realistic(DEEPSEEK_V3, target, times, chunk, 0.1, 4, 8)


def test_realistic_stage_costs_sum_to_the_model(realistic: Realistic) -> None:
    model = realistic.layers
    parts = [model.embedding, *model.decoder, *model.mtp, model.loss]
    total = sum(parts[1:], parts[0])
    assert len(model.decoder) == 61 and len(model.mtp) == 1
    dense, moe = model.decoder[0], model.decoder[3]
    assert dense.Fo == dense.Bo == 0 < moe.Fo  # dense layers have no all-to-all to hide
    for v in variants((2,), auto_layout=True):
        if v.optimize:
            continue
        sched = build_variant(v, 4, 8)
        plan = realistic.plan(sched, v.overlap, v.auto_layout)
        for d in range(sched.directions):
            stages = [plan.costs.stages[(d, s)] for s in range(sched.stages)]
            summed = sum(stages[1:], stages[0])
            assert (summed.F, summed.B, summed.W) == (total.F, total.B, total.W), v.label
            if v.overlap:
                assert (summed.Fo, summed.Bo) == (total.Fo, total.Bo), v.label
        assert plan.layout.startswith("E") and plan.layout.endswith("mL")


def test_realistic_interleaved_4_at_p16_holds_the_embedding_and_the_loss_alone() -> None:
    """61 layers fill P=16 x 4 virtual stages only as Megatron's layout 'E|t|...|t|m|L': the MTP
    layer's all-to-all on its own stage, every logit (the model's and MTP's) on the loss's."""
    chunk = count_chunk(DEEPSEEK_V3_STAGE)
    real = Realistic(DEEPSEEK_V3, DEEPSEEK_V3_STAGE, stage_times(DEEPSEEK_V3_STAGE, chunk, None, None, Network()),
                     chunk, 0.1, 16, 16)
    auto = next(v for v in variants((4,), auto_layout=True) if v.label == "interleaved-4+a2a auto")
    sched = build_variant(auto, 16, 16)
    plan = real.plan(sched, True, True)
    assert plan.layout == "E|" + "t|" * 61 + "m|L"
    assert plan.costs.comm[(0, 62)] == real.a2a and plan.costs.comm[(0, 63)] == (0, 0)
    assert plan.activations[(0, 63)] == 2 * real.logits and plan.params[(0, 63)] == real.table
    with pytest.raises(ScheduleError, match="cannot fill 64 stages"):
        real.plan(sched, True, False)


def test_uniform_stage_cost_file_reproduces_the_uniform_projection(tmp_path: Path) -> None:
    t = times(F=1, B=2, W=0.5, FB=3, a2a=0.5, p2p=0.25)  # lone F+B = 4, a pair 3 at loss 0
    uniform = schedule_costs(t, overlap=True, loss=0)
    doc = {"c": 0.25, "fb_ratio": 0.75,
           "stages": [{"d": 0, "s": s, "F": 1.5, "B": 2.5, "W": 0.5} for s in range(4)]}
    assert uniform == Costs.of("1.5", "2.5", "0.5", 3, "0.25")
    path = tmp_path / "uniform.json"
    path.write_text(json.dumps(doc))
    from_file = FromFile(StageCosts.from_json_obj(json.loads(path.read_text())), 4)
    rows = variants((2, 4))
    want = project(Uniform(t, 0, 4), 4, 8, rows)
    got = project(from_file, 4, 8, rows)
    for a, b in zip(want, got):
        assert a.variant == b.variant
        assert a.result.makespan == b.result.makespan, a.variant.label
        assert a.result.bubble_ratio == b.result.bubble_ratio
        assert a.peak_stage_activations == b.peak_stage_activations
        assert a.params_stages == b.params_stages and b.exposed_a2a_ms is None


def test_cli_realistic_placement_and_stage_cost_rows(tmp_path: Path, capsys) -> None:
    out = tmp_path / "real.json"
    assert main(["project", "--placement", "realistic", "-P", "4", "-M", "8", "--chunks", "2,4",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Placement: realistic (61 layers, the first 3 dense, 1 MTP" in text and "Layouts (" in text
    doc = json.loads(out.read_text())
    got = {r["schedule"]: r for r in doc["rows"]}
    assert set(got) == {v.label for v in variants((2, 4), auto_layout=True)}
    for name in ("dualpipe", "dualpipev"):
        assert got[f"{name} auto"]["step_ms"] <= got[name]["step_ms"] + 1e-9
        assert got[f"{name} auto+opt"]["step_ms"] <= got[f"{name} auto"]["step_ms"] + 1e-9
    assert got["interleaved-4"]["stages"] == 16 and got["zbv"]["stages"] == 8
    assert got["1f1b"]["layout"] == "E" + "t" * 15 + "|" + "t" * 16 + "|" + "t" * 16 + "|" + "t" * 14 + "mL"
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"c": 0.01, "fb_ratio": 0.8, "stages": [
        {"d": 0, "s": s, "F": 10 + s, "B": 20, "W": 5} for s in range(4)]}))
    assert main(["project", "--stage-costs", str(path), "-P", "4", "-M", "8"]) == 0
    text = capsys.readouterr().out
    assert f"stage costs from {path} (4 stages" in text and "| dualpipev+opt |" in text
    assert main(["project", "--stage-costs", str(path), "--placement", "realistic"]) == 2
    assert "drop --placement" in capsys.readouterr().err
