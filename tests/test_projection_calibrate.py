"""``projection calibrate`` on synthetic GPU profiles with known answers, and the projection fixes it needs.

The traces are built with test_trace_profile's Kineto-shaped :class:`Trace` (the structure of
DeepSeek's ``train.json``: a main thread with the ranges, an autograd thread without, DeepEP
kernels on their own stream); every figure below is worked out by hand in the comments.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from test_trace_profile import AUTOGRAD, CAST, COMBINE, COMM, COMPUTE, COMPUTE2, DISPATCH, GEMM, NCCL, Trace

from dualpipe_megatron.projection import (DEEPSEEK_V3, DEEPSEEK_V3_STAGE, PRESETS, Network, OpCosts, count_chunk,
                                          stage_times)
from dualpipe_megatron.projection.calibrate import calibrate
from dualpipe_megatron.projection.cli import main
from dualpipe_megatron.projection.comm import a2a_ms
from dualpipe_megatron.projection.costs import overlapped_fb
from dualpipe_megatron.projection.placement import PairCosts, Realistic
from dualpipe_megatron.projection.project import build_variant, variants
from dualpipe_megatron.schedules.ir import FB, B, F, Key
from dualpipe_megatron.trace.kineto import read_profiles

pytestmark = pytest.mark.unit

LAYERS = 2
# Per layer, by hand (the layer at offset o = 100 ms x its index):
#   compute summed: F 8 + 7 = 15, B (input grad) 12 + 1 = 13, W 6 + 4 = 10
#   compute union: [1,9) [12,24) [32,43) [48,52) [63,64) = 36 (W on a second stream under mlp(F))
#   communication: forward 6 + 4 = 10, backward 5 + 3 = 8; union 18
#   exposed: [10,12) [30,32) [46,48) [60,63) = 9; hidden 9
PER_LAYER = {"F": 15, "B_input": 13, "W": 10, "B": 23, "F_then_B": 36}
COMM_MS = {"forward": 10, "backward": 8}
SHARE = 9 * LAYERS / min(36 * LAYERS, 18 * LAYERS)  # exposed / the shorter of compute and comm


def deepseek_pair(t: Trace) -> None:
    """One F&B pair of two chunks of ``LAYERS`` layers, ranges named as in DeepSeek's train.json."""
    t.range("ProfilerStep#1", 0, 100 * LAYERS)
    t.range("1F1B", 0, 100 * LAYERS - 1)
    for i in range(LAYERS):
        o = 100 * i
        t.range("attn(F)", o, o + 10)
        t.kernel(GEMM, COMPUTE, o + 1, o + 9, launch=o + 0.5)
        t.range("dispatch(F)", o + 10, o + 12)
        t.kernel(DISPATCH, COMM, o + 10, o + 16, launch=o + 10)
        t.range("attn(B)", o + 12, o + 30)
        t.kernel(GEMM, COMPUTE, o + 12, o + 24, launch=o + 13, tid=AUTOGRAD)  # placed by time
        t.range("combine(F)", o + 30, o + 32)
        t.kernel(COMBINE, COMM, o + 30, o + 34, launch=o + 30)
        t.range("mlp(W)", o + 32, o + 36)
        t.kernel(GEMM, COMPUTE2, o + 32, o + 38, launch=o + 32.5)
        t.range("mlp(F)", o + 36, o + 46)
        t.kernel(GEMM, COMPUTE, o + 36, o + 43, launch=o + 36.5)
        t.range("dispatch(B)", o + 46, o + 48)
        t.kernel(DISPATCH, COMM, o + 46, o + 51, launch=o + 46, tid=AUTOGRAD)
        t.range("attn(W)", o + 48, o + 60)
        t.kernel(GEMM, COMPUTE, o + 48, o + 52, launch=o + 48.5)
        t.range("combine(B)", o + 60, o + 62)
        t.kernel(COMBINE, COMM, o + 60, o + 63, launch=o + 60, tid=AUTOGRAD)
        t.kernel(CAST, COMM, o + 63, o + 64, launch=o + 61, tid=AUTOGRAD)  # compute, on the comm stream


@pytest.fixture(scope="module")
def deepseek_costs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, OpCosts]:
    t = Trace()
    deepseek_pair(t)
    path = t.write(tmp_path_factory.mktemp("trace") / "train.json")
    return path, calibrate(read_profiles([path]), DEEPSEEK_V3_STAGE)


def test_deepseek_names_known_answer(deepseek_costs: tuple[Path, OpCosts]) -> None:
    _, costs = deepseek_costs
    assert costs.ms == pytest.approx(PER_LAYER)
    assert costs.comm_ms == pytest.approx(COMM_MS)
    assert costs.exposed_share == pytest.approx(SHARE)
    assert costs.shape == replace(DEEPSEEK_V3_STAGE, num_layers=1) and costs.device == "NVIDIA H800"
    info = costs.info
    assert (info["pairs"], info["pair_layers"], info["layers_per_chunk"]) == (1, LAYERS, LAYERS)
    assert info["pair_measured_ms"]["compute"] == pytest.approx(36 * LAYERS)
    assert info["pair_measured_ms"]["exposed_communication"] == pytest.approx(9 * LAYERS)
    again = OpCosts.from_json_obj(json.loads(json.dumps(costs.to_json_obj())))
    assert (again.ms, again.comm_ms, again.exposed_share) == (costs.ms, costs.comm_ms, costs.exposed_share)


def test_our_names_known_answer(tmp_path: Path) -> None:
    """dualpipe op ranges hold whole chunks: ms per layer = per op / --layers-per-chunk."""
    t = Trace()
    t.range("dualpipe F d0 s0 m0", 0, 10)
    t.kernel(GEMM, COMPUTE, 0, 8, launch=0.5)
    t.kernel(NCCL, COMM, 8, 12, launch=1)  # forward all-to-all 4
    t.range("dualpipe B d0 s0 m0", 20, 40)
    t.kernel(GEMM, COMPUTE, 20, 36, launch=21, tid=AUTOGRAD)  # full B 16
    t.kernel(NCCL, COMM, 36, 42, launch=22, tid=AUTOGRAD)  # backward all-to-all 6
    t.range("dualpipe B d0 s0 m1 w=false", 50, 60)
    t.kernel(GEMM, COMPUTE, 50, 60, launch=51)  # B_input 10
    t.range("dualpipe W d0 s0 m1", 60, 70)
    t.kernel(GEMM, COMPUTE, 60, 66, launch=61)  # W 6
    t.range("dualpipe FB F(d0 s0 m2) B(d0 s0 m3 w=false)", 100, 130)
    t.kernel(GEMM, COMPUTE, 100, 118, launch=101)  # pair compute 18 (+ W 6 = F_then_B 24)
    t.kernel(NCCL, COMM, 110, 122, launch=102)  # 8 hidden, 4 exposed of 12
    path = t.write(tmp_path / "rank0.json")
    with pytest.raises(Exception, match="give --layers-per-chunk"):
        calibrate(read_profiles([path]), DEEPSEEK_V3_STAGE)
    costs = calibrate(read_profiles([path]), DEEPSEEK_V3_STAGE, layers_per_chunk=2)
    assert costs.ms == pytest.approx({"F": 4, "B": 8, "B_input": 5, "W": 3, "F_then_B": 12})
    # backward: 6 ms over both backward ops (full and w=false) of 2 layers each
    assert costs.comm_ms == pytest.approx({"forward": 2, "backward": 1.5})
    assert costs.exposed_share == pytest.approx(4 / 12)


def test_cli_calibrate_then_project_uses_the_measurements(deepseek_costs, tmp_path: Path, capsys) -> None:
    path, costs = deepseek_costs
    out, proj = tmp_path / "costs.json", tmp_path / "proj.json"
    assert main(["calibrate", str(path), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    # the pair projected from the costs: 72 compute + 0.5 x 36 = 90 = measured busy 72 + 18
    assert f"F&B pair of {LAYERS} layers: projected from these costs 90.0 ms; measured 90.0 ms busy" in text
    assert json.loads(out.read_text())["format"] == "dualpipe-op-costs/2"
    assert main(["project", "--op-costs", str(out), "-P", "4", "-M", "8", "--layers-per-rank", "4",
                 "--chunks", "2", "--json", str(proj)]) == 0
    text = capsys.readouterr().out
    assert "| tokens/s/GPU |" in text and "all-to-all 40.0 ms forward + 32.0 ms backward (measured" in text
    doc = json.loads(proj.read_text())
    assert doc["overlap_loss"] == pytest.approx(SHARE)  # the file's measured share, not 0.1
    assert doc["stage_ms"]["a2a_fwd"] == pytest.approx(4 * COMM_MS["forward"])
    for row in doc["rows"]:
        tokens = 8 * DEEPSEEK_V3_STAGE.tokens / 4  # M x tokens per micro-batch / P
        assert row["tokens_per_s_per_gpu"] == pytest.approx(tokens / (row["step_ms"] / 1e3))


def test_measured_all_to_all_scales_by_the_network_models_ratio(deepseek_costs) -> None:
    _, costs = deepseek_costs
    net = Network()
    for target in (replace(DEEPSEEK_V3_STAGE, num_layers=4, hidden=2 * 7168),
                   replace(DEEPSEEK_V3_STAGE, num_layers=4, ep=32)):
        t = stage_times(target, count_chunk(target), costs, None, net)
        ratio = a2a_ms(target, net) / a2a_ms(costs.shape, net)
        assert (t.a2a_fwd, t.a2a_bwd) == pytest.approx((COMM_MS["forward"] * ratio, COMM_MS["backward"] * ratio))
    doubled = replace(DEEPSEEK_V3_STAGE, num_layers=4, hidden=2 * 7168)
    assert a2a_ms(doubled, net) / a2a_ms(costs.shape, net) == pytest.approx(8)  # 4 layers x 2 x bytes
    assert stage_times(doubled, count_chunk(doubled), replace(costs, comm_ms=None), None, net).a2a_fwd == \
        pytest.approx(a2a_ms(doubled, net))  # no measurement: the network model


def _realistic(costs: OpCosts) -> Realistic:
    target = replace(DEEPSEEK_V3_STAGE, num_layers=4)
    chunk = count_chunk(target)
    times = stage_times(target, chunk, costs, None, Network())
    return Realistic(DEEPSEEK_V3, target, times, chunk, costs.exposed_share, 4, 8)


def _moe_pair(real: Realistic) -> tuple[PairCosts, FB]:
    """Stage costs of plain 1F1B at P=4 (split 15|16|16|14: stages 1 and 2 all MoE, 16 each), and a
    pair of stage 1's F with stage 2's B."""
    sched = build_variant(variants((2,))[0], 4, 8)
    plan = real.plan(sched, True, False)
    return plan.costs, FB(F(Key(0, 1, 0)), B(Key(0, 2, 0)))


def test_pair_costs_r_times_compute_plus_loss_times_all_to_all(deepseek_costs) -> None:
    """Defect (a): the pair cost r x compute + loss x A2A (was compute + (1 - r + loss) x A2A)."""
    _, costs = deepseek_costs
    costs = replace(costs, comm_ms={"forward": 5, "backward": 4})  # compute exceeds the all-to-all
    real = _realistic(costs)
    pair_costs, op = _moe_pair(real)
    n, r = 16, 36 / (15 + 23)
    compute, comm = n * (15 + 23) * r, n * (5 + 4)
    want = compute + SHARE * comm
    assert float(pair_costs.duration(op)) == pytest.approx(want, rel=2e-4)
    # the simulator's linear form (the layout search and the optimizer use it) agrees here
    linear = super(PairCosts, pair_costs).duration(op)
    assert float(linear) == pytest.approx(want, rel=2e-4)
    assert float(pair_costs.exposed(op)) == pytest.approx(SHARE * comm, rel=2e-4)


def test_pair_judged_on_its_own_when_all_to_all_exceeds_a_layers_forward(deepseek_costs) -> None:
    """Defect (b): DeepSeek's regime (F compute 15 < its all-to-all 20, the pair's 38 x r > 36)
    projects, and a pair whose all-to-all exceeds its compute costs A + loss x C."""
    _, costs = deepseek_costs
    costs = replace(costs, comm_ms={"forward": 20, "backward": 16})
    pair_costs, op = _moe_pair(_realistic(costs))
    n, r = 16, 36 / 38
    assert float(pair_costs.duration(op)) == pytest.approx(n * 38 * r + SHARE * n * 36, rel=2e-4)
    slow = replace(costs, comm_ms={"forward": 30, "backward": 30})
    pair_costs, op = _moe_pair(_realistic(slow))
    compute, comm = n * 38 * r, n * 60
    assert float(pair_costs.duration(op)) == pytest.approx(overlapped_fb(compute, comm, SHARE), rel=2e-4)
    assert float(pair_costs.duration(op)) == pytest.approx(comm + SHARE * compute, rel=2e-4)


def test_calibrate_errors_are_one_line(tmp_path: Path, capsys) -> None:
    host = tmp_path / "cpu.json"
    host.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "dualpipe F d0 s0 m0", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]}))
    for argv, fragment in [([str(host)], "no GPU kernels"),
                           ([str(tmp_path / "none.json")], "no such file"),
                           ([str(host), "--preset", "nope"], "invalid choice")]:
        assert main(["calibrate", *argv, "-o", str(tmp_path / "o.json")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and fragment in err, err


def test_format_1_files_still_read(tmp_path: Path) -> None:
    tiny = PRESETS["tiny"]
    shape = {"hidden": 64, "heads": 2, "q_lora": 32, "kv_lora": 16, "qk_nope": 16, "qk_rope": 8, "v_head": 16,
             "experts": 16, "ep": 4, "topk": 2, "expert_ffn": 32, "shared_experts": 1, "seq": 32, "mbs": 1, "layers": 1}
    doc = {"format": "dualpipe-op-costs/1", "shape": shape,
           "ms": {"F": 1, "B": 2, "B_input": 1.5, "W": 0.5, "F_then_B": 3}}
    costs = OpCosts.from_json_obj(doc)
    assert costs.shape == tiny and costs.comm_ms is None and costs.exposed_share is None
    with pytest.raises(Exception, match="exposed_share must be a number within"):
        OpCosts.from_json_obj({**doc, "format": "dualpipe-op-costs/2", "exposed_share": 2})
