import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Test helpers (contract_checker, worker modules) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

from launcher import STRICT_ENV  # noqa: E402 - found through the path above

# Every multi-rank test runs in strict mode: each pipeline step's p2p calls (and the
# collectives issued during it) are checked against the model of NCCL's semantics, and a
# step that could deadlock on NCCL fails (dualpipe_megatron/runtime/strict.py). The launcher
# gives it to every rank it starts; this process has it too.
os.environ.setdefault(STRICT_ENV, "1")

# The Transformer Engine and Megatron-Bridge tiers run apart, in their venvs: scripts/tier.sh.
collect_ignore = ["te", "bridge"]

# Every test module here declares exactly one tier, module-wide (pyproject.toml registers them):
# ``pytestmark = pytest.mark.unit`` (in-process: no process group, no subprocess, no launch; seconds),
# ``pytest.mark.slow`` (in-process too, but searches and sweeps of tens of seconds) or
# ``pytest.mark.multiprocess`` (starts processes or a process group).
TIERS = ("unit", "slow", "multiprocess")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected module is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse to run a module without one tier, so that no test drops out of every ``-m`` tier,
    or lands in two."""
    here = Path(__file__).parent
    bad = set()
    for item in items:
        if item.path.parent != here:
            continue
        tiers = [mark.name for mark in item.iter_markers() if mark.name in TIERS]
        if len(tiers) != 1:
            bad.add(f"{item.path.name} ({' and '.join(tiers) or 'no tier'})")
    if bad:
        raise pytest.UsageError(
            "each test module in tests/ declares exactly one tier, module-wide: pytestmark = pytest.mark."
            f"{', pytest.mark.'.join(TIERS)} (tests/conftest.py); not so: {', '.join(sorted(bad))}")


@pytest.fixture(scope="session")
def route_records(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The guard's record of each route (scripts/route_patches.py), taken by the launcher in a
    fresh interpreter: for test_guard.py and test_upstream_patch.py."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path_factory.mktemp("routes") / "records.json"
    run = subprocess.run([sys.executable, "-m", "dualpipe_megatron.launch", str(root / "scripts" / "route_patches.py"),
                          "--json", str(out)], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())
