"""patches/megatron-core-0.19.2-schedule-extension-point.patch, applied to a copy of the
installed ``megatron`` package (never in place) and trained through.

Real 2-rank CPU runs of a stock GPT script (tests/stock_pretrain_gpt.py, which builds through a
config container, so through the patch's ``build_virtual_pipeline_stages`` hook) under
tests/upstream_driver.py: DualPipeV through the launcher with the registered plugin on the patched
copy; the same run through the launcher's runtime patches on the unpatched install (training and
evaluation losses must match to the printed digit); the patched copy with no plugin (plain 1F1B:
the extension point must be inert); and ``scripts/pretrain_gpt.py`` started directly, whose
guard record and losses must equal the launcher's (one install routine for both).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from launcher import REPO, LaunchFailed, job_env, marked_json, torchrun
from pretrain_runs import EVAL, LOSS

pytestmark = pytest.mark.multiprocess

PATCH = REPO / "patches" / "megatron-core-0.19.2-schedule-extension-point.patch"
DRIVER = Path(__file__).with_name("upstream_driver.py")
STOCK_SCRIPT = Path(__file__).with_name("stock_pretrain_gpt.py")
PLUGINS_FILE = Path("megatron") / "training" / "schedule_plugins.py"
RUN_TIMEOUT_S = 150

FLAGS = (
    "--num-layers 4 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
    "--max-position-embeddings 8 --micro-batch-size 1 --global-batch-size 8 --train-iters 4 "
    "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 64 --distributed-backend gloo "
    "--transformer-impl local --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion "
    "--no-persist-layer-norm --log-interval 1 --eval-iters 1 --eval-interval 4 "
    "--hidden-dropout 0 --attention-dropout 0 --seed 1234 "
    "--position-embedding-type learned_absolute --pipeline-model-parallel-size 2"
).split()
DUALPIPEV = ["--pipeline-schedule", "dualpipev"]
ITERATIONS = [1, 2, 3, 4]
RUNTIME_PATCHED = [
    "megatron.training.arguments.add_megatron_arguments",
    "megatron.training.arguments.validate_args",
    "megatron.core.parallel_state.initialize_model_parallel",
    "megatron.training.training.get_model",
    "megatron.training.models.dist_utils.build_virtual_pipeline_stages",
    "megatron.training.models.build_virtual_pipeline_stages",
    "megatron.training.training.get_forward_backward_func",
    "megatron.training.checkpointing.check_checkpoint_args",
]
# What building a DualPipeV model without MTP patches, on either route (docs/training.md).
MODEL_PATCHES = {"stage predicates", "linear weight-grad deferral", "delayed-wgrad deferral"}

# Evaluation at iteration 4, then on the validation and test sets after training.
EVALUATIONS = ["4", "4 on test set", "4 on validation set"]
REPORT = "UPSTREAM_REPORT"  # the mark of the JSON line upstream_driver.py prints


def installed_megatron() -> Path:
    """The installed ``megatron`` package directory (a namespace package: core + training)."""
    return Path(importlib.util.find_spec("megatron.training").origin).parent.parent


APPLY = {
    "patch": ["patch", "-p1", "--forward", "--batch", "-i", str(PATCH)],
    "git": ["git", "apply", "-p1", "--verbose", str(PATCH)],  # outside a repository: like patch
}


def apply_patch(root: Path, tool: str, reverse: bool = False) -> None:
    """Apply (or revert) PATCH under ``root`` with ``tool``, asserting it applies exactly (no
    offset, no fuzz)."""
    cmd = APPLY[tool] + (["-R"] if reverse else [])
    # Keep git from treating an enclosing repository as the tree to patch.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{out}"
    assert not re.search(r"offset|fuzz|reject", out, re.IGNORECASE), f"not a clean apply:\n{out}"


def available_tool() -> str:
    """GNU patch, as patches/README.md says; git where patch is not installed."""
    for tool in APPLY:
        if shutil.which(tool):
            return tool
    pytest.skip("neither GNU patch nor git is installed, so the patch cannot be applied")


@pytest.fixture(scope="module")
def patched_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a patched copy of the installed ``megatron`` package."""
    root = tmp_path_factory.mktemp("patched_megatron")
    shutil.copytree(installed_megatron(), root / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__"))
    apply_patch(root, available_tool())
    return root


def train(out_dir: Path, mode: str, pythonpath: list[Path], flags: list[str]) -> dict[str, Any]:
    """One 2-rank torchrun of the driver: logged lm losses (training and evaluation), the
    ranks' reports and the log."""
    path = os.pathsep.join(map(str, pythonpath))
    env = job_env(PYTHONPATH=path, DUALPIPE_MOCK_DOCUMENTS="64")
    try:
        text = torchrun(f"training run {mode!r} (PYTHONPATH={path})", 2,
                        [str(DRIVER), mode, str(STOCK_SCRIPT), *flags], env, out_dir / f"{mode}.log",
                        RUN_TIMEOUT_S)
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return {"losses": {int(i): loss for i, loss in LOSS.findall(text)},
            "eval_losses": dict(EVAL.findall(text)),
            "reports": marked_json(text, REPORT),
            "log": text}


@pytest.fixture(scope="module")
def plugin_run(patched_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train(tmp_path_factory.mktemp("plugin"), "launch", [patched_root, REPO], FLAGS + DUALPIPEV)


@pytest.fixture(scope="module")
def runtime_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train(tmp_path_factory.mktemp("runtime"), "launch", [REPO], FLAGS + DUALPIPEV)


@pytest.fixture(scope="module")
def script_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``scripts/pretrain_gpt.py`` run directly: it installs the hooks itself."""
    return train(tmp_path_factory.mktemp("script"), "script", [REPO], FLAGS + DUALPIPEV)


@pytest.fixture(scope="module")
def inert_run(patched_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train(tmp_path_factory.mktemp("inert"), "none", [patched_root, REPO], FLAGS)


def _training_patches(report: dict[str, Any]) -> dict[str, list[str]]:
    """The guard's record at the end of a run, CPU compat aside (megatron_cpu.md lists it)."""
    return {name: labels for name, labels in report["installed"].items() if name != "CPU compat"}


def check_route_record(route: str, report: dict[str, Any], route_records: dict) -> None:
    """A run's guard record against the record of the routes (scripts/route_patches.py, the
    tables of docs/training.md): what installing ``route`` patched, the sets a job may add, and
    each set's symbols as a job under the runtime patches holds them."""
    symbols = route_records["job"]
    installs = {"plugin": [], "runtime patches": list(route_records["runtime patches"])}[route]
    adds = [name for name in symbols if name not in installs] + ["mirror replicas"]
    assert sorted(set(report["installed_at_start"]) - {"CPU compat"}) == sorted(installs)
    at_end = _training_patches(report)
    assert set(installs) | MODEL_PATCHES <= set(at_end) <= set(installs) | set(adds), at_end
    assert {name: labels for name, labels in at_end.items() if name != "mirror replicas"} == {
        name: symbols[name] for name in at_end if name != "mirror replicas"}


def _load_plugins_module(root: Path) -> Any:
    """A private instance of the patched ``schedule_plugins`` (it imports nothing from megatron)."""
    spec = importlib.util.spec_from_file_location("schedule_plugins_copy", root / PLUGINS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reports_that_run_into_each_other_are_both_read() -> None:
    """Two ranks share the log and an unbuffered print writes its newline apart: one rank's
    report can run on into the other's (seen once in a clean-clone run)."""
    log = f'x\n{REPORT} {{"rank": 0, "m": {{"k": "}}"}}}}{REPORT} {{"rank": 1}}\n\n{REPORT} {{"rank": 2}}\n'
    assert marked_json(log, REPORT) == [{"rank": 0, "m": {"k": "}"}}, {"rank": 1}, {"rank": 2}]


def test_patch_adds_only_the_extension_point(patched_root: Path) -> None:
    changed = re.findall(r"^\+\+\+ b/(\S+)", PATCH.read_text(), re.MULTILINE)
    assert changed == ["megatron/training/arguments.py", "megatron/training/checkpointing.py",
                       "megatron/training/initialize.py", "megatron/training/models/dist_utils.py",
                       "megatron/training/schedule_plugins.py", "megatron/training/training.py"]
    assert (patched_root / PLUGINS_FILE).is_file()
    assert not (installed_megatron() / "training" / "schedule_plugins.py").exists()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_apply_gives_the_same_files_and_reverts(patched_root: Path, tmp_path: Path) -> None:
    changed = re.findall(r"^\+\+\+ b/(\S+)", PATCH.read_text(), re.MULTILINE)
    pristine = {name: installed_megatron().parent / name for name in changed}
    for name, source in pristine.items():
        if source.exists():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, tmp_path / name)
    apply_patch(tmp_path, "git")
    for name in changed:
        assert (tmp_path / name).read_bytes() == (patched_root / name).read_bytes(), name
    apply_patch(tmp_path, "git", reverse=True)
    for name, source in pristine.items():
        if source.exists():
            assert (tmp_path / name).read_bytes() == source.read_bytes(), name
        else:
            assert not (tmp_path / name).exists(), f"{name} left behind by the revert"


def test_hooks_are_no_ops_without_a_plugin(patched_root: Path) -> None:
    plugins = _load_plugins_module(patched_root)
    parser, args, model = object(), object(), [object()]
    assert plugins.get_schedule_plugin() is None
    assert plugins.add_arguments(parser) is parser
    assert plugins.model_chunk_pre_post_process(args, 1, True, False) == (True, False)
    assert plugins.finalize_model(args, model) is model
    assert plugins.get_embedding_ranks(args, None) is None
    assert plugins.get_embedding_ranks(args, len) is len  # the script's own choice stays
    assert plugins.get_forward_backward_func(args, schedule_pg_collection=None) is None
    plugins.pre_validate_args(args)
    plugins.post_validate_args(args)
    plugins.check_checkpoint_args(args, args)


def test_a_plugin_may_define_only_some_hooks(patched_root: Path) -> None:
    plugins = _load_plugins_module(patched_root)

    class Swap:
        def model_chunk_pre_post_process(self, args: Any, vp_stage: int | None, pre: bool,
                                         post: bool) -> tuple[bool, bool]:
            return post, pre

    plugin = Swap()
    plugins.register_schedule_plugin(plugin)
    plugins.register_schedule_plugin(plugin)  # the same plugin again: a no-op
    assert plugins.get_schedule_plugin() is plugin
    assert plugins.model_chunk_pre_post_process(None, 0, True, False) == (False, True)
    assert plugins.get_forward_backward_func(None) is None
    with pytest.raises(RuntimeError, match="already registered"):
        plugins.register_schedule_plugin(Swap())


def test_register_refuses_an_unpatched_megatron() -> None:
    from dualpipe_megatron.megatron import upstream_plugin

    assert not upstream_plugin.has_extension_point()
    with pytest.raises(RuntimeError, match="schedule-extension-point.patch"):
        upstream_plugin.register()


def test_plugin_trains_dualpipev_without_runtime_patches(plugin_run: dict[str, Any], patched_root: Path,
                                                         route_records: dict) -> None:
    assert sorted(plugin_run["losses"]) == ITERATIONS, plugin_run["log"][-4000:]
    assert len(plugin_run["reports"]) == 2  # one per rank
    copy = patched_root / "megatron" / "training"
    for report in plugin_run["reports"]:
        assert report["route"] == "plugin"
        assert report["megatron_training"] == str(copy)
        assert report["get_model_file"] == str(copy / "training.py")  # Megatron's own get_model
        assert "training flag support" not in report["installed"]
        assert "EPLB" not in report["installed"]  # no --eplb-* flag: EPLB left Megatron alone
        check_route_record("plugin", report, route_records)
        assert report["registered_plugin"] == "DualPipeSchedulePlugin"
        # train() and each evaluate() took their forward_backward_func from the plugin.
        schedules = report["plugin_schedules"]
        assert len(schedules) == 1 + len(EVALUATIONS), schedules
        assert all(s.startswith("dualpipe_megatron.megatron.schedule.") for s in schedules), \
            schedules


def test_plugin_losses_equal_runtime_patch_losses(plugin_run: dict[str, Any], runtime_run: dict[str, Any],
                                                  route_records: dict) -> None:
    for report in runtime_run["reports"]:
        assert report["route"] == "runtime-patches"
        assert report["megatron_training"] == str(installed_megatron() / "training")
        # The check the plugin run passes is live:
        assert report["installed"]["training flag support"] == RUNTIME_PATCHED
        assert "EPLB" not in report["installed"]
        check_route_record("runtime patches", report, route_records)
    assert sorted(runtime_run["losses"]) == ITERATIONS, runtime_run["log"][-4000:]
    assert sorted(runtime_run["eval_losses"]) == EVALUATIONS, runtime_run["log"][-4000:]
    assert plugin_run["losses"] == runtime_run["losses"]
    assert plugin_run["eval_losses"] == runtime_run["eval_losses"]


def test_launcher_and_script_install_the_same(runtime_run: dict[str, Any], script_run: dict[str, Any]) -> None:
    """One install routine for both entry points: the guard records the same patches (CPU compat's
    groups, dataset_helpers among them, included) once installed and after the run, and the runs
    log the same losses."""
    launched, direct = runtime_run["reports"], script_run["reports"]
    assert len(launched) == len(direct) == 2
    for a, b in zip(launched, direct):
        assert a["route"] == b["route"] == "runtime-patches"
        assert a["installed_at_start"] == b["installed_at_start"]
        assert a["installed"] == b["installed"]
    groups = launched[0]["installed_at_start"]["CPU compat"]
    assert any(label.endswith("datasets.utils.compile_helpers") for label in groups), groups
    assert sorted(script_run["losses"]) == ITERATIONS, script_run["log"][-4000:]
    assert script_run["losses"] == runtime_run["losses"]
    assert script_run["eval_losses"] == runtime_run["eval_losses"]


def test_patched_megatron_without_plugin_runs_1f1b(inert_run: dict[str, Any],
                                                   patched_root: Path) -> None:
    assert sorted(inert_run["losses"]) == ITERATIONS, inert_run["log"][-4000:]
    assert sorted(inert_run["eval_losses"]) == EVALUATIONS, inert_run["log"][-4000:]
    assert len(inert_run["reports"]) == 2
    for report in inert_run["reports"]:
        assert report["megatron_training"] == str(patched_root / "megatron" / "training")
        assert report["registered_plugin"] is None
        assert _training_patches(report) == {}
