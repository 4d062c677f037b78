"""Run Megatron pretraining jobs (torchrun, CPU, gloo, mock data unless told) and read their logs.

Every comparison starts from one checkpoint made by a PP=1 run with learning rate 0, because
Megatron seeds each pipeline rank differently and two layouts would otherwise start from
different weights.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launcher import free_port

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
FORK_LAUNCH = Path(__file__).with_name("fork_launch.py")
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
GRAD_NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?grad norm: ([0-9.E+-]+)")
# Evaluation during training, then on the validation and test sets after it.
EVAL = re.compile(r"validation loss at iteration (\d+(?: on \w+ set)?) \| lm loss value: ([0-9.E+-]+)")

MODEL = ("--num-layers 8 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
         "--max-position-embeddings 8 --vocab-size 64 --position-embedding-type learned_absolute "
         "--hidden-dropout 0 --attention-dropout 0").split()
CPU = ("--distributed-backend gloo --transformer-impl local --use-cpu-initialization "
       "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
       "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm").split()
DATA = ("--mock-data --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 16 "
        "--seed 1234 --log-interval 1 --eval-interval 1000 --eval-iters 0").split()
TRAIN = "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1".split()


class RunFailed(RuntimeError):
    pass


class _LaunchServer:
    """``fork_launch.py --serve``, started on first use: it imports torch and Megatron once for
    every job of the test session (each job still forks its ranks from a fresh launcher)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        self.stderr = tempfile.TemporaryFile()  # the server's own output (its imports), for failures

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            self.proc = subprocess.Popen([sys.executable, str(FORK_LAUNCH), "--serve"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=REPO)
            self.pending = b""
        return self.proc

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise subprocess.TimeoutExpired("fork_launch.py --serve", timeout)
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                self.stderr.seek(0)
                said = self.stderr.read().decode(errors="replace")[-6000:]
                raise RunFailed(f"the launch server (fork_launch.py --serve) exited:\n{said}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, nproc: int, args: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
        proc = self._start()
        request = {"nproc": nproc, "port": str(free_port()), "args": args, "env": env, "log": str(log),
                   "cwd": str(REPO)}
        proc.stdin.write((json.dumps(request) + "\n").encode())
        proc.stdin.flush()
        pid = self._answer(IMPORT_TIMEOUT)["pid"]
        try:
            return self._answer(timeout)["code"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)  # its ranks and manager die with it
            self._answer(60)
            raise


_SERVER = _LaunchServer()
IMPORT_TIMEOUT = 300  # the server's one import of torch and Megatron, on a loaded machine


def run(name: str, out: Path, nproc: int, args: list[str], command: list[str] | None = None,
        timeout: float = 400, mock_data: bool = True) -> str:
    """One job; returns its log (raises RunFailed with the log tail if it fails).

    Our script goes through the launch server (one import for every rank of every job);
    another entry point (``command``) through torchrun, as a user would start it. Without
    ``mock_data`` the job reads what ``args`` name (``--data-path ...``)."""
    log = out / f"{name}.log"
    data = DATA if mock_data else [flag for flag in DATA if flag != "--mock-data"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DUALPIPE_MOCK_DOCUMENTS": "64"}
    job = [*MODEL, *CPU, *data, *args]
    if command:
        cmd = [str(TORCHRUN), f"--nproc-per-node={nproc}", f"--master-port={free_port()}", *command, *job]
        with log.open("w") as fh:
            code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                  timeout=timeout).returncode
    else:
        cmd = [sys.executable, str(FORK_LAUNCH), str(nproc), "PORT", *job]  # what the server runs
        code = _SERVER.run(nproc, job, env, log, timeout)
    text = log.read_text(errors="replace")
    if code != 0:
        raise RunFailed(f"{name}: exit code {code}\n{' '.join(cmd)}\n{text[-6000:]}")
    return text


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
