"""The GPU launch templates: valid bash, and dry runs whose command Megatron and our checks accept.

No GPU, torchrun job or SLURM is needed: a dry run prints the command and runs nothing
(``TORCHRUN=false``/no ``srun`` would fail otherwise). The printed pretraining arguments go
through Megatron's own argument parser with our flags and through our schedule checks, so a
typo'd flag or a layout that does not fit the stages fails here, not on a cluster. The dry
run's plan (``dualpipe_megatron.plan``) runs in-process on the printed arguments for both
schedules, with the GPU node's facts (Transformer Engine, CUDA) mocked so Megatron's own
``validate_args`` runs too; one dry run runs the plan as the script does, to a refusal.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
TORCHRUN_SH = REPO / "scripts" / "launch_torchrun.sh"
SLURM = REPO / "scripts" / "launch_slurm.sbatch"
PROXY = dict(NNODES="1", PP="2", EP="4", NUM_LAYERS="16", LAYOUT="", HIDDEN="2048", FFN_HIDDEN="8192",
             HEADS="16", NUM_EXPERTS="64", GBS="64")


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "DRY_RUN"))}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=120,
                          env={**clean, "TORCHRUN": "false", "PLAN": "0", "PYTHON": sys.executable, **env},
                          cwd=REPO)


def _command(output: str) -> list[str]:
    """The command line printed after the ``# command`` marker."""
    lines = output.splitlines()
    return shlex.split(lines[lines.index("# command") + 1])


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from dualpipe_megatron.megatron.training_hooks import add_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    return add_arguments(add_megatron_arguments(parser))


def _check_pretrain_args(cmd: list[str]) -> argparse.Namespace:
    from dualpipe_megatron.megatron import refusals, training_hooks
    from dualpipe_megatron.megatron.model import check_configuration

    launcher = dict(zip(cmd[1:], cmd[2:]))
    script = next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py"))
    args = _parser().parse_args(cmd[script + 1:])
    world = int(launcher["--nnodes"]) * int(launcher["--nproc-per-node"])
    dp = world // (args.pipeline_model_parallel_size * args.tensor_model_parallel_size)
    # The templates target GPU nodes with Transformer Engine, which FP8 needs (it is absent here).
    with mock.patch.object(refusals, "_have_transformer_engine", lambda: True):
        training_hooks.pre_validate(args)
    check_configuration(args.pipeline_schedule, args.pipeline_model_parallel_size,
                        args.global_batch_size // (args.micro_batch_size * dp), args.num_layers,
                        args.dualpipe_layout, args.mtp_num_layers or 0)
    return args


@pytest.mark.parametrize("script", [TORCHRUN_SH, SLURM], ids=["torchrun", "slurm"])
def test_bash_syntax(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("env", "dry_flag"), [({"DRY_RUN": "1"}, False), ({}, True)],
                         ids=["DRY_RUN=1", "--dry-run"])
def test_torchrun_dry_run_is_deepseek_v3_like(env: dict[str, str], dry_flag: bool) -> None:
    result = _run(TORCHRUN_SH, *(["--dry-run"] if dry_flag else []), "--train-iters", "7", **env)
    assert result.returncode == 0, result.stderr
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in result.stdout
    assert "2048 GPUs = PP 16 x TP 1 x DP 128 (EP 64), 120 micro-batches" in result.stdout
    cmd = _command(result.stdout)
    assert cmd[0] == "false" and "--nnodes" in cmd
    args = _check_pretrain_args(cmd)
    assert (args.pipeline_schedule, args.pipeline_model_parallel_size, args.expert_model_parallel_size) == \
        ("dualpipev", 16, 64)
    assert (args.fp8, args.fp8_recipe) == ("e4m3", "blockwise")
    assert args.dualpipe_layout == "Et|(tt|)*30mL"  # the MTP layer with the loss, on rank 0
    assert args.train_iters == 7  # extra arguments come last and win
    _assert_deepseek_v3(args)


def _assert_deepseek_v3(args: argparse.Namespace) -> None:
    """DeepSeek-V3's architecture (arXiv 2412.19437, its config.json), setting by setting."""
    assert args.num_layers == 61 and args.moe_layer_freq == [0] * 3 + [1] * 58  # the first 3 dense
    assert (args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (7168, 128, 18432)
    assert args.multi_latent_attention and args.qk_layernorm
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (256, 8, 2048)
    assert args.moe_shared_expert_intermediate_size == 2048  # one shared expert of the routed width
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (8, 4)
    assert args.moe_router_score_function == "sigmoid" and args.moe_router_enable_expert_bias
    assert args.moe_router_topk_scaling_factor == 2.5
    assert args.mtp_num_layers == 1 and args.vocab_size == 129280 and args.seq_length == 4096
    assert (args.pipeline_model_parallel_size, args.expert_model_parallel_size) == (16, 64)


def test_torchrun_dry_run_proxy_options() -> None:
    result = _run(TORCHRUN_SH, "--dry-run", **{**PROXY, "TP": "2", "EP": "2"}, FP8="0",
                  DATA_PATH="0.5 /d/a 0.5 /d/b", TRACE_DIR="/tmp/tr", CKPT_DIR="/ckpt")
    assert result.returncode == 0, result.stderr
    args = _check_pretrain_args(_command(result.stdout))
    assert args.fp8 is None and args.data_path == ["0.5", "/d/a", "0.5", "/d/b"] and not args.mock_data
    assert args.dualpipe_trace == "/tmp/tr" and args.save == "/ckpt" and args.sequence_parallel
    assert args.dualpipe_layout is None and args.num_experts == 64


@pytest.mark.parametrize(("env", "message"), [
    (dict(PP="3"), "do not divide into PP=3"),
    (dict(GBS="1024"), "8 micro-batches per step; dualpipev needs >= 2 x PP = 32"),
    (dict(EP="256"), "do not divide into EP=256"),
])
def test_torchrun_rejects_inconsistent_sizes(env: dict[str, str], message: str) -> None:
    result = _run(TORCHRUN_SH, "--dry-run", **env)
    assert result.returncode == 2 and message in result.stderr


@pytest.mark.parametrize(("env", "dry_flag"), [({"DRY_RUN": "1"}, False), ({}, True)],
                         ids=["DRY_RUN=1", "--dry-run"])
def test_slurm_dry_run(env: dict[str, str], dry_flag: bool) -> None:
    result = _run(SLURM, *(["--dry-run"] if dry_flag else []), "--train-iters", "3", **env,
                  TRACE_DIR="/traces")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    srun = shlex.split(lines[lines.index("# srun") + 1])
    assert srun[0] == "srun" and srun[-3:] == [str(TORCHRUN_SH), "--train-iters", "3"]
    cmd = _command(result.stdout)
    assert cmd[cmd.index("--master-addr") + 1] == "MASTER_HOST" and cmd[cmd.index("--node-rank") + 1] == "0"
    args = _check_pretrain_args(cmd)
    assert args.dualpipe_trace == "/traces/job-dry-run" and args.train_iters == 3


def _plan(cmd: list[str]) -> tuple[list[str], float]:
    """The dry run's plan of a printed command, in-process, on a GPU node as mocked here:
    Transformer Engine present (FP8), CUDA present (so Megatron's validate_args runs) with a
    Hopper's compute capability (grouped GEMMs) and a recent TE. Returns the report and the
    seconds it took (the Megatron import not counted: ``_parser`` paid it)."""
    import time

    import torch
    from megatron.training import arguments

    from dualpipe_megatron.plan import job as plan_job
    from dualpipe_megatron.megatron import refusals

    _parser()
    launcher = dict(zip(cmd[1:], cmd[2:]))
    world = int(launcher["--nnodes"]) * int(launcher["--nproc-per-node"])
    script = next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py"))
    start = time.perf_counter()
    with mock.patch.object(refusals, "_have_transformer_engine", lambda: True), \
            mock.patch.object(plan_job, "_have_cuda", lambda: True), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *_: (9, 0)), \
            mock.patch.object(arguments, "is_te_min_version", lambda *_, **__: True):
        lines = plan_job.report(plan_job.check(plan_job.parse(cmd[script + 1:], world)))
    return lines, time.perf_counter() - start


@pytest.mark.parametrize(("schedule", "stages", "layout"), [
    ("dualpipev", 32, "Et|tt|" + "tt|" * 29 + "mL"),
    ("dualpipe", 16, "Etttt|" + "tttt|" * 14 + "tmL"),
])
def test_dry_run_plan(schedule: str, stages: int, layout: str) -> None:
    """The full-size template's plan under each schedule's default layout: every check passes,
    Megatron's included (61 layers do not divide by P=16: our layout must reach it as one), and
    the report has the layout, a memory row per rank and the projected step."""
    result = _run(TORCHRUN_SH, "--dry-run", SCHEDULE=schedule)
    assert result.returncode == 0, result.stderr
    lines, seconds = _plan(_command(result.stdout))
    text = "\n".join(lines)
    assert lines[0].startswith(f"# plan: {schedule} on 2048 GPUs = PP 16 x TP 1 x DP 128 (EP 64), 120 micro"), text
    assert "checks: ours passed" in text and "Megatron's validate_args passed" in text
    assert f"layout (--dualpipe-layout, {stages} stages): {layout}" in text
    # DeepSeek-V3 has 671B parameters (its MTP module is counted apart).
    assert "parameters: 671.0" in text and "B in its MTP layers" in text
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == list(range(16))
    stage_pairs = [tuple(int(s) for s in r.split("|")[2].split(",")) for r in rows]
    assert stage_pairs[0] == ((0, 31) if schedule == "dualpipev" else (0, 15))
    for row in rows:  # params, weights+grads+optimizer, peak activations: all present and positive
        assert all(float(cell) > 0 for cell in row.split("|")[4:7]), row
    step = next(line for line in lines if line.startswith("projected step: "))
    assert float(step.split()[2].replace(",", "")) > 0 and "tokens/s/GPU" in step, step
    assert seconds < 30, seconds


def _peaks(lines: list[str]) -> list[float]:
    """The report's peak-activations column (GiB), rank by rank."""
    return [float(line.split("|")[6]) for line in lines if line.startswith("| ") and line[2].isdigit()]


def test_dry_run_plan_of_a_budgeted_job_is_the_budgeted_order() -> None:
    """The one-node proxy (DualPipeV, P=2, 16 micro-batches: DeepSeek's order keeps 5 stage
    activations live on each rank) under ``--dualpipe-max-activations 3``: the plan's peaks and
    step are those of the order training runs within K = 3, lower peaks on every rank and a
    longer step, named in the step line; without the flag the plan is DeepSeek's order's."""
    plain = _run(TORCHRUN_SH, "--dry-run", **PROXY, FP8="0")
    budgeted = _run(TORCHRUN_SH, "--dry-run", "--dualpipe-max-activations", "3", **PROXY, FP8="0")
    assert plain.returncode == budgeted.returncode == 0, (plain.stderr, budgeted.stderr)
    deepseek, _ = _plan(_command(plain.stdout))
    ours, _ = _plan(_command(budgeted.stdout))
    assert all(k < d for k, d in zip(_peaks(ours), _peaks(deepseek), strict=True)), (ours, deepseek)
    step = {name: next(line for line in lines if line.startswith("projected step: "))
            for name, lines in (("deepseek", deepseek), ("ours", ours))}
    assert "network model, DeepSeek's op order;" in step["deepseek"]
    assert ("the op order optimized for the uniform costs F=1 B=2 W=1 F&B=3 within 3 live stage activations "
            "per rank;") in step["ours"]
    assert float(step["ours"].split()[2].replace(",", "")) > float(step["deepseek"].split()[2].replace(",", ""))
    # Everything but the peaks and the step is the job's, not the order's.
    assert [line for line in deepseek if line.startswith(("#", "checks", "layout", "parameters", "memory"))] == \
        [line for line in ours if line.startswith(("#", "checks", "layout", "parameters", "memory"))]


def test_dry_run_plan_refuses_a_layout_of_the_other_schedule() -> None:
    """The script runs the plan after the command; DualPipe given DualPipeV's 2P-stage layout
    is refused there with our check's message and a non-zero exit (no Transformer Engine here,
    so without FP8)."""
    result = _run(TORCHRUN_SH, "--dry-run", SCHEDULE="dualpipe", LAYOUT="Et|(tt|)*30mL", FP8="0", PLAN="1")
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "# command" in result.stdout and "# plan" not in result.stdout
    assert "refused: --pipeline-schedule dualpipe: pipeline layout has 32 stages; this schedule needs 16" \
        in result.stderr


def test_parameter_count_matches_megatrons_estimate() -> None:
    """The plan's parameter count of the template equals Megatron's own estimator's total
    (``theoretical_memory_usage``, printed to 10 M), once the MTP parts Megatron's leaves out
    (two norms, the [hidden; embedding] projection, a final norm) are taken off ours."""
    import contextlib
    import copy
    import io

    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    from dualpipe_megatron.plan import job as plan_job
    from dualpipe_megatron.plan.memory import padded_vocab, stage_params

    result = _run(TORCHRUN_SH, "--dry-run", FP8="0")
    cmd = _command(result.stdout)
    _parser()
    args = plan_job.parse(cmd[next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py")) + 1:], 2048)
    plan_job.check(args)
    ours = sum(p.total for p in stage_params(args, args.pipeline_model_parallel_layout.stage_layers, shard=False))
    h = args.hidden_size
    megatron_args = copy.copy(args)
    megatron_args.padded_vocab_size = padded_vocab(args)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        compute_weight_and_optimizer_memory(megatron_args, verbose=True)
    total = next(line for line in printed.getvalue().splitlines() if line.startswith("Total number of parameters"))
    assert total.split()[-1] == f"{(ours - args.mtp_num_layers * (3 * h + 2 * h * h)) / 1e9:.2f}", total


def _compare(cmd: list[str], gpu_memory: float | None = None) -> tuple[list, int | None]:
    """``--compare``'s rows for a printed command, mocked as :func:`_plan` is."""
    import torch
    from megatron.training import arguments

    from dualpipe_megatron.plan import job as plan_job
    from dualpipe_megatron.megatron import refusals

    _parser()
    script = next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py"))
    world = int(dict(zip(cmd[1:], cmd[2:]))["--nproc-per-node"])
    with mock.patch.object(refusals, "_have_transformer_engine", lambda: True), \
            mock.patch.object(plan_job, "_have_cuda", lambda: True), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *_: (9, 0)), \
            mock.patch.object(arguments, "is_te_min_version", lambda *_, **__: True):
        checked = plan_job.check(plan_job.parse(cmd[script + 1:], world))
        _, rows, best = plan_job.comparison(checked, 8, None, gpu_memory)
        return rows, best


def test_compare_rows_agree_with_the_plan_of_the_same_options() -> None:
    """``plan --compare`` on the one-node proxy: every training schedule has a row, and the
    DualPipeV row's step, activations and memory per rank are the one-schedule plan's for
    the same layout and order (the plan run with that row's schedule and layout)."""
    base = _command(_run(TORCHRUN_SH, "--dry-run", **PROXY, FP8="1").stdout)
    rows, best = _compare(base, gpu_memory=80)
    labels = [r.label for r in rows]
    for wanted in ("1f1b", "interleaved-2+a2a auto", "zbv", "dualpipe auto+opt", "dualpipev auto"):
        assert wanted in labels, labels
    assert [r.step_ms for r in rows] == sorted(r.step_ms for r in rows)
    assert best is not None and rows[best].fits and rows[best].flags
    assert all(r.fits == (max(r.peak_gib) <= 80) for r in rows)
    row = rows[labels.index("dualpipev auto")]
    lines, _ = _plan([*base, "--dualpipe-layout", row.layout])
    one = next(line for line in lines if line.startswith("projected step: "))
    assert float(one.split()[2].replace(",", "")) == pytest.approx(row.step_ms, abs=0.05)
    assert _peaks(lines) == [round(a, 1) for a in row.activation_gib]
