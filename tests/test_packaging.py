"""Packaging: installing this project into an existing Megatron environment keeps its torch.

``pyproject.toml`` declares version ranges (an NGC container or a cluster environment already
has torch and megatron-core, and ``pip install`` must not replace them); the exact versions CI
tests live in ``requirements.txt``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def _dependencies() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(line) for line in project["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def _operators(req: Requirement) -> set[str]:
    return {spec.operator for spec in req.specifier}


def test_dependencies_are_ranges_not_pins():
    deps = _dependencies()
    for name, req in deps.items():
        assert not _operators(req) & {"==", "==="}, f"{req} pins {name}; declare a range"

    torch, megatron = deps["torch"], deps["megatron-core"]
    assert torch.specifier and megatron.specifier, "torch and megatron-core need version ranges"

    # megatron-core: the whole 0.19.x series and nothing else (guard.check_version refuses others).
    for ok in ("0.19.0", "0.19.2", "0.19.9"):
        assert Version(ok) in megatron.specifier, f"{megatron} rejects {ok}"
    for bad in ("0.18.3", "0.20.0", "1.0.0"):
        assert Version(bad) not in megatron.specifier, f"{megatron} admits {bad}"

    # torch: at least every version megatron-core itself accepts, from its lowest bound up.
    mcore_torch = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or []]
    mcore_torch = [r for r in mcore_torch if canonicalize_name(r.name) == "torch" and r.marker is None]
    assert mcore_torch, "megatron-core declares no torch requirement to compare with"
    lower = [Version(s.version) for r in mcore_torch for s in r.specifier if s.operator in (">=", ">")]
    for version in lower:
        assert version in torch.specifier, f"our {torch} is narrower than megatron-core's {mcore_torch[0]}"
    if not any(_operators(r) & {"<", "<=", "~=", "=="} for r in mcore_torch):
        assert not _operators(torch) & {"<", "<=", "~=", "=="}, (
            f"{torch} has an upper bound that megatron-core does not")


def test_installed_and_ci_pins_satisfy_the_ranges():
    """The versions in this environment and the pins in requirements.txt fit the ranges."""
    deps = _dependencies()
    for name, req in deps.items():
        installed = Version(importlib.metadata.version(name))
        assert req.specifier.contains(installed, prereleases=True), f"installed {name} {installed} vs {req}"
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            pins[canonicalize_name(req.name)] = req
    for name, req in deps.items():
        if name in pins:
            (spec,) = pins[name].specifier
            assert Version(spec.version) in req.specifier, f"requirements.txt {pins[name]} vs {req}"


def test_pip_install_keeps_the_installed_torch_and_megatron(tmp_path):
    """A real resolver run: ``pip install --dry-run`` of this project into the running venv.

    Offline and hermetic: ``--no-index``, no ``PIP_*`` variables or pip config files (so no
    find-links directory either), ``--no-build-isolation`` (the build backend, setuptools, is
    already installed and cannot be downloaded). Every dependency must therefore be satisfied by
    what is installed; a dependency pinned to a version other than the installed one fails the
    resolution here, and one that pip would replace shows up in the report's ``install`` list.
    The project is copied first, so the metadata build writes nothing into the checkout.
    """
    try:
        import pip  # noqa: F401
    except ImportError:
        pytest.skip("pip is not installed in this interpreter")
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(ROOT / "dualpipe_megatron", project / "dualpipe_megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
         "--no-index", "--no-build-isolation", str(project)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, (
        "pip could not install this project offline into the current environment, i.e. without "
        f"changing installed packages:\n{proc.stdout}\n{proc.stderr}")
    install = json.loads(report.read_text())["install"]
    names = {canonicalize_name(item["metadata"]["name"]) for item in install}
    assert "torch" not in names and "megatron-core" not in names, f"pip would install {sorted(names)}"
    assert names == {"dualpipe-megatron"}, f"pip would install {sorted(names)}"
