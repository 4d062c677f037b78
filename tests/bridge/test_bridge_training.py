"""Megatron-Bridge's own ``pretrain()`` under dualpipev and dualpipe against Bridge's own 1F1B, on CPU:
``scripts/pretrain_bridge_gpt.py`` jobs, each started from one PP=1 checkpoint (Megatron seeds each
pipeline rank differently), their logged lm losses compared.

- dense GPT (fp32), P=2, with Bridge's evaluation, and the MoE at EP=2 x P=2 run F then B (fp32, under dualpipev): to 1e-6
  relative (measured: equal in all 7 printed digits);
- the MoE with the F&B overlap (bf16 weights, which Megatron's overlap asks for, gradients
  accumulated in fp32): to 1e-5 relative, room for bf16 rounding in the overlapped plans' order
  (measured: equal in all 7 printed digits).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import REPO, free_port
from pretrain_runs import eval_losses, losses

SCRIPT = REPO / "scripts" / "pretrain_bridge_gpt.py"
ITERS = 6


def _job(name: str, out: Path, **env: str) -> str:
    log = out / f"{name}.log"
    run_env = os.environ | {"MASTER_PORT": str(free_port()), "ITERS": str(ITERS),
                            "DUALPIPE_MOCK_DOCUMENTS": "64"} | env
    with log.open("w") as stream:
        done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT)], env=run_env, stdout=stream,
                              stderr=subprocess.STDOUT, timeout=400, cwd=REPO)
    text = log.read_text()
    assert done.returncode == 0, f"{name} failed:\n{text[-4000:]}"
    return text


def _runs(out: Path, schedules: list[str], **env: str) -> dict[str, str]:
    start = out / "start"
    _job("start", out, PP="1", ITERS="1", SAVE=str(start), SCHEDULE="1f1b", **env)
    return {schedule: _job(schedule, out, SCHEDULE=schedule, LOAD=str(start), TRACE=str(out / f"trace_{schedule}"),
                           **env) for schedule in schedules}


def _check(out: Path, logs: dict[str, str], rel: float, world: int) -> None:
    reference = losses(logs.pop("1f1b"))
    assert sorted(reference) == list(range(1, ITERS + 1)), reference
    assert not (out / "trace_1f1b").exists()
    for schedule, log in logs.items():
        assert len(list((out / f"trace_{schedule}").iterdir())) == world, f"{schedule}: our schedule did not run"
        got = losses(log)
        assert got.keys() == reference.keys(), (schedule, got)
        for iteration, loss in reference.items():
            assert got[iteration] == pytest.approx(loss, rel=rel), (schedule, iteration, got, reference)


def test_dense_gpt_equals_bridge_1f1b(tmp_path: Path) -> None:
    """With Bridge's evaluation every 3 iterations and on the validation and test sets at the end
    (our schedules' forward-only steps)."""
    logs = _runs(tmp_path, ["1f1b", "dualpipev", "dualpipe"], EVAL="3")
    reference = eval_losses(logs["1f1b"])
    assert len(reference) == 4, reference
    for schedule in ("dualpipev", "dualpipe"):
        assert eval_losses(logs[schedule]) == pytest.approx(reference, rel=1e-6), schedule
    _check(tmp_path, logs, rel=1e-6, world=2)


def test_moe_overlapped_equals_bridge_1f1b(tmp_path: Path) -> None:
    logs = _runs(tmp_path, ["1f1b", "dualpipev", "dualpipe"], MOE="1")
    assert all("MoE F&B overlap off" not in log for log in logs.values())
    _check(tmp_path, logs, rel=1e-5, world=4)


def test_moe_f_then_b_equals_bridge_1f1b(tmp_path: Path) -> None:
    _check(tmp_path, _runs(tmp_path, ["1f1b", "dualpipev"], MOE="1", MOE_OVERLAP="0"), rel=1e-6, world=4)
