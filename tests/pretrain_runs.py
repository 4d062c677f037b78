"""Megatron pretraining jobs (CPU, gloo, mock data unless told) through tests/launcher.py, and their logs read.

Every comparison starts from one checkpoint made by a PP=1 run with learning rate 0, because
Megatron seeds each pipeline rank differently and two layouts would otherwise start from
different weights.
"""

from __future__ import annotations

import re
from pathlib import Path

from launcher import PRETRAIN_GPT, REPO, fork_pretrain, job_env, torchrun

from dualpipe_megatron.megatron.cpu_compat import CPU_FLAGS as CPU

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.E+-]+)")
# Evaluation during training, then on the validation and test sets after it.
EVAL = re.compile(r"validation loss at iteration (\d+(?: on \w+ set)?) \| lm loss value: ([0-9.E+-]+)")

MODEL = ("--num-layers 8 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
         "--max-position-embeddings 8 --vocab-size 64 --position-embedding-type learned_absolute "
         "--hidden-dropout 0 --attention-dropout 0").split()
DATA = ("--mock-data --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 16 "
        "--seed 1234 --log-interval 1 --eval-interval 1000 --eval-iters 0").split()
TRAIN = "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1".split()


def run(name: str, out: Path, nproc: int, args: list[str], command: list[str] | None = None,
        timeout: float = 400, mock_data: bool = True, script: Path = PRETRAIN_GPT) -> str:
    """One job; returns its log (raises launcher.LaunchFailed with the log tail if it fails).

    ``script`` (our ``scripts/pretrain_gpt.py`` unless told) goes through the fork server (one
    import for every rank of every job, the script then run as the launcher runs it); another
    entry point (``command``) through torchrun, as a user would start it. Without ``mock_data``
    the job reads what ``args`` name (``--data-path ...``)."""
    log = out / f"{name}.log"
    data = DATA if mock_data else [flag for flag in DATA if flag != "--mock-data"]
    env = job_env(PYTHONPATH=str(REPO), DUALPIPE_MOCK_DOCUMENTS="64")
    job = [*MODEL, *CPU, *data, *args]
    if command:
        return torchrun(name, nproc, [*command, *job], env, log, timeout)
    return fork_pretrain(name, nproc, job, env, log, timeout, script)


def losses(log: str) -> dict[int, float]:
    return {int(it): float(value) for it, value in LOSS.findall(log)}


def grad_norms(log: str) -> dict[int, float]:
    return {int(it): float(value) for it, value in GRAD_NORM.findall(log)}


def logged(log: str, key: str) -> dict[int, float]:
    """Any ``key: value`` of the per-iteration log line (``loss scale``, ``number of skipped
    iterations``...), by iteration."""
    pattern = re.compile(rf"iteration\s+(\d+)/\s*\d+ \|.*?{re.escape(key)}:\s+([0-9.E+-]+)")
    return {int(it): float(value) for it, value in pattern.findall(log)}


def eval_losses(log: str) -> dict[str, float]:
    return {when: float(value) for when, value in EVAL.findall(log)}


def init_checkpoint(out: Path) -> Path:
    """Iteration 1 at PP=1 with learning rate 0: the shared starting weights."""
    path = out / "init"
    run("init", out, 1, ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-decay-style",
                         "constant", "--lr-warmup-iters", "0", "--save", str(path),
                         "--save-interval", "1"])
    return path
