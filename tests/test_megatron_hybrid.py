"""HybridModel (Megatron-Core's successor to GPTModel) under DualPipeV and DualPipe equals Megatron's
1F1B on the same model, built with our local hybrid spec (CPU, gloo, mock data).

Dense, ``*-*-*-*-`` at P=2 with q/k layernorm (one GPT block is two hybrid layers, so this is the
4-layer GPT):

- a 4-layer GPTModel starts at PP=1 and trains iterations 2-3 under DualPipeV, saving at 3;
- that GPT checkpoint loads into the HybridModel (Megatron's load-time translation, optimizer state
  included) under 1F1B, DualPipeV and DualPipe, which train iterations 4-8 and log the same losses;
- the DualPipeV HybridModel run saves at 6 and DualPipe resumes from it (a hybrid checkpoint across
  schedules): iterations 7-8 as 1F1B's, by Megatron's resume logging rule;
- the W split ran: the first step's W ops ran deferred weight-grad closures;
- the DualPipe run's op trace (``--dualpipe-trace``) reads back as DualPipe's schedule.

MoE: the DeepSeek-V3 proxy (``scripts/deepseek_v3_proxy.flags``) written as a hybrid pattern, MLA
``+`` (Megatron-Core 0.19's symbol; ``*`` is standard attention), the dense first block ``+-``, then
seven ``+E``, and MTP ``/+E``, with expert bias, EPLB and EP=2 x P=2: both schedules against 1F1B
(lm and MTP loss), the expert bias equal in DualPipe's two copies, experts moved, and the notice that
MoE F&B pairs run F then B (Megatron-Core's schedule plans cover GPTModel only).

A CUDA-only layer kind (Mamba) is refused when the local spec builds it, naming the kind.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from launcher import LaunchFailed
from pretrain_runs import TRAIN, losses, run
from test_deepseek_v3_proxy import MTP, proxy_flags

from dualpipe_megatron.eplb.experts import _layer_key
from dualpipe_megatron.megatron.hybrid import stage_layout, stage_segments
from dualpipe_megatron.megatron.refusals import argument_problems
from dualpipe_megatron.schedules import ScheduleError
from dualpipe_megatron.trace import analyze, load

pytestmark = pytest.mark.multiprocess

SPEC = ["--spec", "dualpipe_megatron.megatron.local_specs", "hybrid_stack_spec"]
P2 = ["--pipeline-model-parallel-size", "2"]
# q/k layernorm on standard attention: the local spec names torch's norm per layer (LocalAttentionLayer).
DENSE = [*SPEC, "--hybrid-layer-pattern", "*-*-*-*-", "--qk-layernorm", *P2]
GPT4 = ["--num-layers", "4", "--qk-layernorm"]
RTOL = 1e-5
FIRST = ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-decay-style", "constant",
         "--lr-warmup-iters", "0"]
W_SPLIT = re.compile(r"DualPipe W split: the first training step's W ops on this rank ran (\d+) deferred")
STAGES = re.compile(r"dualpipe: HybridModel layers by model stage: (\S+)")
NO_OVERLAP = "DualPipe MoE F&B overlap off, running F then B: HybridModel has no build_schedule_plan"
PROXY_PATTERN = "+-" + "+E" * 7 + "/+E"
# The proxy's GPT-only flags: the pattern places the layers, MoE and MTP.
GPT_ONLY = ("--num-layers", "--moe-layer-freq", "--mtp-num-layers")
PROXY_ITERS = 4
BIAS_CHECKED = re.compile(r"^DualPipe expert-bias check: all (\d+) router copies equal", re.MULTILINE)
MOVED = re.compile(r"^EPLB iteration (\d+): moved (\d+) expert", re.MULTILINE)


def _failing(exc: LaunchFailed) -> None:
    pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("hybrid_dense")
    gpt_init, gpt_saved, hybrid_saved = out / "gpt_init", out / "gpt_dualpipev", out / "hybrid_dualpipev"
    logs: dict[str, str] = {}
    try:
        run("gpt_init", out, 1, [*GPT4, *FIRST, "--save", str(gpt_init), "--save-interval", "1"])
        run("gpt_dualpipev", out, 2, [
            *GPT4, *P2, "--pipeline-schedule", "dualpipev", "--load", str(gpt_init), "--no-load-optim",
            "--no-load-rng", *TRAIN, "--train-iters", "8", "--save", str(gpt_saved), "--save-interval", "3",
            "--exit-interval", "3"])
        extra = {"dualpipev": ["--save", str(hybrid_saved), "--save-interval", "6"],
                 "dualpipe": ["--dualpipe-trace", str(out / "trace")]}
        for schedule in ("1f1b", "dualpipev", "dualpipe"):
            logs[schedule] = run(schedule, out, 2, [*DENSE, "--pipeline-schedule", schedule, "--load", str(gpt_saved),
                                                    *TRAIN, "--train-iters", "8", *extra.get(schedule, [])])
        logs["dualpipe_resumed"] = run("dualpipe_resumed", out, 2, [
            *DENSE, "--pipeline-schedule", "dualpipe", "--load", str(hybrid_saved), "--ckpt-step", "6", *TRAIN,
            "--train-iters", "8"])
    except LaunchFailed as exc:
        _failing(exc)
    logs["trace"] = str(out / "trace")
    return logs


def _same(ref: dict[int, float], got: dict[int, float], iterations: range, what: str) -> None:
    assert [i for i in iterations if i not in ref or i not in got] == [], (what, sorted(ref), sorted(got))
    for i in iterations:
        assert got[i] == pytest.approx(ref[i], rel=RTOL), f"{what}, iteration {i}: {got[i]} vs {ref[i]}"


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_dense_hybrid_from_a_gpt_checkpoint_matches_1f1b(dense: dict[str, str], schedule: str) -> None:
    """The GPT checkpoint saved under DualPipeV loads into the HybridModel under each schedule."""
    assert "loading a GPT checkpoint into the hybrid model" in dense[schedule]
    _same(losses(dense["1f1b"]), losses(dense[schedule]), range(4, 9), f"{schedule} lm loss")


def test_dense_stages_follow_the_pattern(dense: dict[str, str]) -> None:
    assert STAGES.findall(dense["dualpipev"]) == ["*-|*-|*-|*-"]
    assert STAGES.findall(dense["dualpipe"]) == ["*-*-|*-*-"]


def test_hybrid_checkpoint_resumes_under_the_other_schedule(dense: dict[str, str]) -> None:
    """Saved by the DualPipeV run at 6, resumed under DualPipe: Megatron's first log after a resume
    averages its iteration with the next."""
    ref = losses(dense["1f1b"])
    want = {7: ref[7], 8: (ref[7] + ref[8]) / 2}
    _same(want, losses(dense["dualpipe_resumed"]), range(7, 9), "resumed lm loss")


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_weight_grad_split_ran(dense: dict[str, str], schedule: str) -> None:
    found = W_SPLIT.findall(dense[schedule])
    assert found and int(found[0]) > 0, found


def test_trace_of_a_hybrid_run(dense: dict[str, str]) -> None:
    traces = load(Path(dense["trace"]))
    assert [t.pipeline_rank for t in traces] == [0, 1]
    assert all(len(t.steps) == 5 for t in traces)  # iterations 4-8
    (report,) = analyze(traces, skip=1)
    assert report.schedule.name == "dualpipe" and report.schedule.microbatches == 16


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("hybrid_proxy")
    model = [*proxy_flags(drop=GPT_ONLY), *SPEC, "--hybrid-layer-pattern", PROXY_PATTERN]
    init = out / "init"
    got: dict[str, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DUALPIPE_CHECK_EXPERT_BIAS", "1")
        try:
            run("init", out, 2, [*model, "--pipeline-model-parallel-size", "1", *FIRST, "--save", str(init),
                                 "--save-interval", "1"])
            for schedule in ("1f1b", "dualpipev", "dualpipe"):
                log = run(schedule, out, 4, [*model, "--pipeline-schedule", schedule, "--load", str(init),
                                             "--no-load-optim", "--no-load-rng", *TRAIN,
                                             "--train-iters", str(1 + PROXY_ITERS)])
                got[schedule] = {"loss": losses(log), "mtp": {int(i): float(v) for i, v in MTP.findall(log)},
                                 "bias_checks": [int(n) for n in BIAS_CHECKED.findall(log)],
                                 "moves": MOVED.findall(log), "log": log}
        except LaunchFailed as exc:
            _failing(exc)
    return got


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_deepseek_v3_proxy_as_a_hybrid_pattern_matches_1f1b(proxy: dict, schedule: str) -> None:
    its = range(2, 2 + PROXY_ITERS)
    _same(proxy["1f1b"]["loss"], proxy[schedule]["loss"], its, "lm loss")
    _same(proxy["1f1b"]["mtp"], proxy[schedule]["mtp"], its, "mtp_1 loss")
    assert NO_OVERLAP in proxy[schedule]["log"]
    assert sum(int(n) for _, n in proxy[schedule]["moves"]) > 0, proxy[schedule]["moves"]


def test_proxy_expert_bias_equal_in_both_copies(proxy: dict) -> None:
    # 8 MoE routers (7 layers + MTP) per model copy, two copies on each of 2 pipeline x 2 EP ranks.
    assert proxy["dualpipe"]["bias_checks"] == [32] * PROXY_ITERS


def test_cuda_only_layer_kind_is_refused(tmp_path) -> None:
    with pytest.raises(LaunchFailed, match=r"hybrid layer 'M' \(Mamba\) needs CUDA kernels"):
        run("mamba", tmp_path, 1, [*SPEC, "--hybrid-layer-pattern", "M*-", "--train-iters", "1"], timeout=200)


def test_pattern_segments_are_model_stages() -> None:
    assert stage_segments("*-*E|*E*E|*E*E|*E*E/*E", 4) == ["*-*E", "*E*E", "*E*E", "*E*E"]
    assert stage_segments("*-*E*E*E", 4) == ["*-", "*E", "*E", "*E"]
    assert stage_layout("*-*E*E*E/*E", 4) == (8, "Ett|tt|tt|ttmL", 1)
    with pytest.raises(ScheduleError, match="2 '\\|' segments; this schedule runs 4 model stages"):
        stage_segments("*-*-|*-*-", 4)
    with pytest.raises(ScheduleError, match="do not split evenly over 4"):
        stage_segments("*-*-*-", 4)


def test_dualpipe_layout_is_refused_for_a_hybrid_model() -> None:
    args = argparse.Namespace(pipeline_schedule="dualpipev", pipeline_model_parallel_size=2, num_layers=None,
                              hybrid_layer_pattern="*-*-*-*-", dualpipe_layout="Et|t|t|tL")
    assert any("--dualpipe-layout does not apply to a HybridModel" in p for p in argument_problems(args))
    args.dualpipe_layout, args.hybrid_layer_pattern = None, "*-*-|*-*-"
    assert argument_problems(args) == [
        "--pipeline-schedule dualpipev: --hybrid-layer-pattern '*-*-|*-*-' has 2 '|' segments; this schedule "
        "runs 4 model stages, one segment each in model order (or give no '|' for an even split)"]


def test_eplb_keys_mtp_layers_by_depth() -> None:
    class Layer:
        layer_number = 2  # a HybridModel MTP depth numbers its inner layers from 1

    assert _layer_key("module.mtp.layers.0.mtp_model_layer.layers.1.mlp", Layer()) == ("mtp", 1)
    assert _layer_key("module.decoder.layers.3.mlp", Layer()) == ("decoder", 2)
