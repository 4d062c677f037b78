"""The GPU launch templates: valid bash, and dry runs whose command Megatron and our checks accept.

No GPU, torchrun job or SLURM is needed: a dry run prints the command and runs nothing
(``TORCHRUN=false``/no ``srun`` would fail otherwise). The printed pretraining arguments go
through Megatron's own argument parser with our flags and through our schedule checks, so a
typo'd flag or a layout that does not fit the stages fails here, not on a cluster.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import subprocess
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCHRUN_SH = REPO / "scripts" / "launch_torchrun.sh"
SLURM = REPO / "scripts" / "launch_slurm.sbatch"
PROXY = dict(NNODES="1", PP="2", EP="4", NUM_LAYERS="16", LAYOUT="", HIDDEN="2048", FFN_HIDDEN="8192",
             HEADS="16", NUM_EXPERTS="64", GBS="64")


def _run(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NNODES", "DRY_RUN"))}
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={**clean, "TORCHRUN": "false", **env}, cwd=REPO)


def _command(output: str) -> list[str]:
    """The command line printed after the ``# command`` marker."""
    lines = output.splitlines()
    return shlex.split(lines[lines.index("# command") + 1])


@functools.cache
def _parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from dualpipe_megatron.megatron.training_support import add_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    return add_arguments(add_megatron_arguments(parser))


def _check_pretrain_args(cmd: list[str]) -> argparse.Namespace:
    from dualpipe_megatron.megatron import support, training_support
    from dualpipe_megatron.megatron.model import check_configuration

    launcher = dict(zip(cmd[1:], cmd[2:]))
    script = next(i for i, a in enumerate(cmd) if a.endswith("pretrain_gpt.py"))
    args = _parser().parse_args(cmd[script + 1:])
    world = int(launcher["--nnodes"]) * int(launcher["--nproc-per-node"])
    dp = world // (args.pipeline_model_parallel_size * args.tensor_model_parallel_size)
    # The templates target GPU nodes with Transformer Engine, which FP8 needs (it is absent here).
    with mock.patch.object(support, "_have_transformer_engine", lambda: True):
        training_support.pre_validate(args)
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
    assert (args.fp8, args.fp8_recipe, args.num_experts, args.moe_router_topk) == ("e4m3", "blockwise", 256, 8)
    assert args.multi_latent_attention and args.num_layers == 61 and args.mtp_num_layers == 1
    assert args.dualpipe_layout == "Et|(tt|)*30mL"  # the MTP layer with the loss, on rank 0
    assert args.train_iters == 7  # extra arguments come last and win


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
