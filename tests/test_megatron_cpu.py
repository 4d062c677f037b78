"""Megatron-Core's own schedules, MoE and optimizer on CPU/gloo through the CPU-compat layer.

One launch of two rank processes (tests/megatron_workers.py) runs every layout; each check
below reads its verdict. A failing or hanging rank fails every check with its log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dualpipe_megatron.megatron.cpu_compat import DISABLE_ENV, GROUPS

WORKER = Path(__file__).with_name("megatron_workers.py")
WORLD_SIZE = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int) -> str:
    return path.read_text(errors="replace")[-chars:]


def _launch(out_dir: Path) -> dict[str, dict[str, object]]:
    out = out_dir / "results.json"
    port = _free_port()
    procs, logs = [], []
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        env.pop(DISABLE_ENV, None)
        logs.append(out_dir / f"rank{rank}.log")
        with logs[-1].open("w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(out)],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=WORKER.parent.parent,
                )
            )
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break  # a dead rank leaves its peers blocked in a collective
        time.sleep(0.2)
    codes = [p.poll() for p in procs]
    if codes != [0] * WORLD_SIZE or not out.exists():
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        why = f"exit codes {codes} (None: killed, still running at failure or after {TIMEOUT_S} s)"
        report = "\n".join(f"--- rank {r} ---\n{_tail(log, 6000)}" for r, log in enumerate(logs))
        pytest.fail(f"Megatron CPU workers failed: {why}\n{report}", pytrace=False)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    return _launch(tmp_path_factory.mktemp("megatron_cpu"))


def test_all_groups_installed_in_workers(results: dict[str, dict[str, object]]) -> None:
    assert results["installed"]["detail"].split(",") == list(GROUPS)


@pytest.mark.parametrize(
    "check",
    [
        "rng_fork",  # Megatron's RNG tracker really forks the (CPU) generator
        "pp2_1f1b",  # PP=2 1F1B == PP=1, losses and every grad bit for bit
        "pp2_vpp2",  # PP=2 x VPP=2 interleaved == PP=1, bit for bit
        "moe_ep2",  # MoE 4 experts top-2 alltoall, EP=2 == EP=1 (losses and grads, 1e-7)
        "ddp_distopt",  # DDP overlapped reduce + distributed optimizer step == torch Adam
    ],
)
def test_megatron_on_cpu(results: dict[str, dict[str, object]], check: str) -> None:
    assert results[check]["ok"], results[check]["detail"]
