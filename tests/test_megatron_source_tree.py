"""A megatron source tree instead of (or ahead of) the installed megatron-core wheel.

The tree is a copy of the installed ``megatron`` package with another patch number in its
``core/package_info.py`` (0.19.7), so the version can only have come from the tree. Three
environments:

- **no distribution visible**: a fresh virtual environment with no packages of its own; its
  ``PYTHONPATH`` holds the tree, this repository and links to everything in our site-packages
  except megatron and its metadata. The guard reads 0.19.7 from the tree, and DualPipeV and
  DualPipe trained there through the launcher (2 ranks, from one PP=1 checkpoint) log Megatron's
  1F1B losses (made with the installed wheel, whose code the tree copies) to 1e-5;
- **a tree shadowing the wheel**: the tree first on ``PYTHONPATH`` of our environment; start-up
  says so in one line and the tree's version is the one checked;
- **a shadowing tree of another series** (0.20.0): refused, naming that version.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from launcher import REPO, LaunchFailed, job_env, torchrun
from pretrain_runs import CPU, DATA, MODEL, TRAIN, init_checkpoint, losses, run

pytestmark = pytest.mark.multiprocess

RTOL = 1e-5
ITERS = ["--train-iters", "5"]
P2 = ["--pipeline-model-parallel-size", "2"]
PROBE = """
import importlib.metadata, json
from dualpipe_megatron import patch_guard
from dualpipe_megatron.megatron.guard import check_version
try:
    installed = importlib.metadata.version("megatron-core")
except importlib.metadata.PackageNotFoundError:
    installed = None
print("PROBE " + json.dumps({"installed": installed, "checked": check_version(),
                             "mismatch": patch_guard.megatron_version_mismatch()}))
"""


def site_packages() -> Path:
    return Path(next(p for p in sys.path if p.endswith("site-packages") and "megatron" in os.listdir(p)))


def source_tree(root: Path, minor: int, patch: int) -> Path:
    """A copy of the installed ``megatron`` package under ``root`` whose package_info says
    0.<minor>.<patch>."""
    shutil.copytree(site_packages() / "megatron", root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    info = root / "megatron" / "core" / "package_info.py"
    text = re.sub(r"^MINOR = \d+", f"MINOR = {minor}", info.read_text(), flags=re.M)
    info.write_text(re.sub(r"^PATCH = \d+", f"PATCH = {patch}", text, flags=re.M))
    return root


def without_megatron(root: Path) -> Path:
    """Links to every entry of our site-packages but megatron, its metadata and this project's
    editable install (the repository goes on PYTHONPATH itself)."""
    root.mkdir()
    hidden = re.compile(r"^(megatron|megatron_core-.*|dualpipe_megatron-.*|__editable__.*|.*\.pth)$")
    for entry in site_packages().iterdir():
        if not hidden.match(entry.name):
            (root / entry.name).symlink_to(entry)
    return root


def probe(python: str, pythonpath: list[Path]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    result = subprocess.run([python, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    return {"code": result.returncode, "out": result.stdout, "err": result.stderr}


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Path]]:
    """(python of a virtual environment with no packages, its PYTHONPATH: tree, repo, the rest)."""
    root = tmp_path_factory.mktemp("source_tree")
    venv.create(root / "venv", with_pip=False, symlinks=True)
    tree = source_tree(root / "src", 19, 7)
    return str(root / "venv" / "bin" / "python"), [tree, REPO, without_megatron(root / "site")]


def test_no_distribution_visible_reads_the_trees_version(bare_env: tuple[str, list[Path]]) -> None:
    result = probe(*bare_env)
    assert result["code"] == 0, result["err"][-3000:]
    found = json.loads(result["out"].split("PROBE ", 1)[1])
    assert found["installed"] is None  # really no megatron-core distribution in sight
    assert found["checked"].split("+")[0] == "0.19.7"
    assert found["mismatch"] is None


def test_a_shadowing_tree_is_said_and_checked(tmp_path: Path) -> None:
    result = probe(sys.executable, [source_tree(tmp_path, 19, 7), REPO])
    assert result["code"] == 0, result["err"][-3000:]
    found = json.loads(result["out"].split("PROBE ", 1)[1])
    assert found["installed"] == "0.19.2" and found["checked"].split("+")[0] == "0.19.7"
    assert "megatron-core 0.19.2 is installed, but the megatron imported here is 0.19.7" in found["mismatch"]


def test_a_shadowing_tree_of_another_series_is_refused(tmp_path: Path) -> None:
    result = probe(sys.executable, [source_tree(tmp_path, 20, 0), REPO])
    assert result["code"] != 0
    assert "megatron-core 0.20.0" in result["err"] and "is not supported" in result["err"], result["err"][-2000:]


def test_both_schedules_train_on_the_tree_as_1f1b_does(bare_env: tuple[str, list[Path]],
                                                       tmp_path: Path) -> None:
    python, pythonpath = bare_env
    init = init_checkpoint(tmp_path)
    start = ["--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN, *ITERS, *P2]
    try:
        reference = losses(run("1f1b", tmp_path, 2, [*start, "--pipeline-schedule", "1f1b"]))
        env = job_env(PYTHONPATH=os.pathsep.join(map(str, pythonpath)), DUALPIPE_MOCK_DOCUMENTS="64")
        got = {}
        for schedule in ("dualpipev", "dualpipe"):
            argv = ["-m", "dualpipe_megatron.launch", str(REPO / "tests" / "stock_pretrain_gpt.py"),
                    *MODEL, *CPU, *DATA, *start, "--pipeline-schedule", schedule]
            log = torchrun(f"{schedule} on the tree", 2, argv, env, tmp_path / f"{schedule}.log", 400,
                           python=python)
            got[schedule] = losses(log)
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    assert sorted(reference) == [2, 3, 4, 5]
    for schedule, logged in got.items():
        assert sorted(logged) == sorted(reference), schedule
        for i, loss in reference.items():
            assert logged[i] == pytest.approx(loss, rel=RTOL), (schedule, i)
