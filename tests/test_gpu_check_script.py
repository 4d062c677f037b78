"""scripts/gpu_check.sh and scripts/nccl_two_rank.py: valid bash, and a script that parses its arguments.

Cheap checks only; the end-to-end CPU run is ``bash scripts/gpu_check.sh --cpu-dry-run`` (about a
minute, not part of the suite).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"
TWO_RANK = REPO / "scripts" / "nccl_two_rank.py"


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=REPO)


def test_gpu_check_is_valid_bash_and_refuses_unknown_arguments() -> None:
    """Exit statuses, not the usage text: 0 for --help, 2 for an argument it does not take."""
    syntax = _run("bash", "-n", str(GPU_CHECK))
    assert syntax.returncode == 0, syntax.stderr
    statuses = {arg: _run("bash", str(GPU_CHECK), arg).returncode for arg in ("--help", "--no-such-flag")}
    assert statuses == {"--help": 0, "--no-such-flag": 2}


def test_two_rank_script_parses_its_arguments() -> None:
    sys.path.insert(0, str(TWO_RANK.parent))
    try:
        from nccl_two_rank import parse_args
    finally:
        sys.path.remove(str(TWO_RANK.parent))
    args = parse_args(["--device", "cpu", "--hidden", "32", "--rows", "4", "--steps", "2", "--timeout", "5",
                       "--schedules", "dualpipev"])
    assert (args.device, args.hidden, args.rows, args.steps, args.timeout, args.schedules) == (
        "cpu", 32, 4, 2, 5.0, ["dualpipev"])
