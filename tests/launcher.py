"""Launch a rank-worker script as WORLD_SIZE real processes (gloo on localhost) and collect
rank 0's JSON verdicts; a dead or hanging rank fails the calling test with every rank's log."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualpipe_megatron.megatron.cpu_compat import DISABLE_ENV

Verdicts = dict[str, dict[str, object]]


def assert_verdict(verdicts: Verdicts, key: str) -> None:
    """One worker check passed (its detail is the failure message)."""
    assert key in verdicts, f"{key} missing; have {sorted(verdicts)}"
    assert verdicts[key]["ok"], verdicts[key]["detail"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:]


def launch(worker: Path, world_size: int, out_dir: Path, timeout_s: float, *args: str) -> Verdicts:
    """Run ``python WORKER OUT_JSON *args`` on ``world_size`` ranks; return OUT_JSON's content."""
    out = out_dir / "results.json"
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        env.pop(DISABLE_ENV, None)
        logs.append(out_dir / f"rank{rank}.log")
        with logs[-1].open("w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), str(out), *args],
                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=worker.parent.parent,
                )
            )
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break  # a dead rank leaves its peers blocked in a collective
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    if codes != [0] * world_size or not out.exists():
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        why = f"exit codes {codes} (None: killed, still running at failure or after {timeout_s} s)"
        report = "\n".join(f"--- rank {r} ---\n{_tail(log, 6000)}" for r, log in enumerate(logs))
        pytest.fail(f"{worker.name} failed: {why}\n{report}", pytrace=False)
    return json.loads(out.read_text())
