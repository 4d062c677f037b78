"""scripts/gpu_check.sh and scripts/nccl_two_rank.py: valid bash, and a script that parses its arguments.

Cheap checks only; the end-to-end CPU run is ``bash scripts/gpu_check.sh --cpu-dry-run`` (about a
minute, not part of the suite).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"
TWO_RANK = REPO / "scripts" / "nccl_two_rank.py"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)


def test_gpu_check_is_valid_bash_with_help() -> None:
    syntax = _run("bash", "-n", str(GPU_CHECK))
    assert syntax.returncode == 0, syntax.stderr
    usage = _run("bash", str(GPU_CHECK), "--help")
    assert usage.returncode == 0, usage.stderr
    assert "--cpu-dry-run" in usage.stdout and "NCCL >= 2.30" in usage.stdout


def test_two_rank_script_parses_its_arguments() -> None:
    usage = _run(sys.executable, str(TWO_RANK), "--help")
    assert usage.returncode == 0, usage.stderr
    for flag in ("--device", "--hidden", "--rows", "--steps", "--timeout"):
        assert flag in usage.stdout
