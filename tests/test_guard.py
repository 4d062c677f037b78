"""The patch guard: exact restores, refusals on drift, one patch set per subsystem."""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from dualpipe_megatron import patch_guard
from dualpipe_megatron.megatron import cpu_compat, guard, training_hooks, wgrad_megatron, wgrad_te
from dualpipe_megatron.patch_guard import PatchSet
from dualpipe_megatron.megatron.model import (
    MIRROR_REPLICAS, save_mirror_copies_as_replicas, uninstall_mirror_replicas,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import route_patches  # noqa: E402 - found through the path above

pytestmark = pytest.mark.multiprocess


class _Target:
    @staticmethod
    def static(x: int) -> int:
        return x

    @classmethod
    def klass(cls, x: int) -> tuple[type, int]:
        return cls, x

    def method(self, a: int, b: int = 1) -> int:
        return a + b


@pytest.fixture
def patches() -> Iterator[PatchSet]:
    patch_set = PatchSet("test")
    yield patch_set
    patch_set.restore()


def test_staticmethod_and_classmethod_restore_exactly(patches: PatchSet) -> None:
    before = {name: inspect.getattr_static(_Target, name) for name in ("static", "klass")}
    assert patches.patch(_Target, "static", lambda x: -x, "(x)")
    assert patches.patch(_Target, "klass", lambda cls, x: (cls, -x), "(x)")
    assert isinstance(inspect.getattr_static(_Target, "static"), staticmethod)
    assert isinstance(inspect.getattr_static(_Target, "klass"), classmethod)
    assert _Target.static(2) == _Target().static(2) == -2
    assert _Target.klass(2) == _Target().klass(2) == (_Target, -2)

    patches.restore()
    for name, value in before.items():
        assert inspect.getattr_static(_Target, name) is value
    assert not patch_guard.is_patched(_Target, "static")


def test_descriptor_kind_must_match(patches: PatchSet) -> None:
    with pytest.raises(RuntimeError, match="a classmethod cannot replace a staticmethod"):
        patches.patch(_Target, "static", classmethod(lambda cls, x: x))
    assert not patches.is_patched(_Target, "static")


def test_megatron_linear_forward_stays_a_staticmethod() -> None:
    from megatron.core.tensor_parallel.layers import \
        LinearWithGradAccumulationAndAsyncCommunication as Linear

    was_installed = wgrad_megatron.PATCHES.is_patched(Linear, "forward")  # by an earlier test
    wgrad_megatron.uninstall_linear_deferral()
    before = {name: inspect.getattr_static(Linear, name) for name in ("forward", "backward")}
    wgrad_megatron.install_linear_deferral()
    try:
        for name in before:
            assert isinstance(inspect.getattr_static(Linear, name), staticmethod)
            assert inspect.getattr_static(Linear, name) is not before[name]
    finally:
        wgrad_megatron.uninstall_linear_deferral()
    for name, value in before.items():
        assert inspect.getattr_static(Linear, name) is value
    if was_installed:
        wgrad_megatron.install_linear_deferral()


def test_wrong_signature_is_refused_and_nothing_patched(patches: PatchSet) -> None:
    original = inspect.getattr_static(_Target, "method")
    with pytest.raises(RuntimeError) as info:
        patches.patch(_Target, "method", lambda self, a, b=2: 0, "(self, a, b=2)")
    message = str(info.value)
    assert "test_guard._Target.method" in message
    assert "expected signature (self, a, b=2), found (self, a, b=1)" in message
    assert "megatron-core 0.19.x" in message
    assert inspect.getattr_static(_Target, "method") is original
    assert not patch_guard.is_patched(_Target, "method")


def test_wrong_megatron_signature_names_symbol_and_versions(patches: PatchSet) -> None:
    from megatron.core.models.common.utils import TransformerLayerNode

    original = inspect.getattr_static(TransformerLayerNode, "backward_dw")
    with pytest.raises(RuntimeError, match=r"common\.utils\.TransformerLayerNode\.backward_dw: "
                                           r"expected signature \(self, extra\), found \(self\); "
                                           r"dualpipe_megatron supports megatron-core 0\.19\.x"):
        patches.patch(TransformerLayerNode, "backward_dw", lambda self, extra: None, "(self, extra)")
    assert inspect.getattr_static(TransformerLayerNode, "backward_dw") is original


def test_a_symbol_belongs_to_one_subsystem(patches: PatchSet) -> None:
    other = PatchSet("other")
    try:
        assert other.patch(_Target, "method", lambda self, a, b=1: 0, "(self, a, b=1)")
        with pytest.raises(RuntimeError, match="other patched it"):
            patches.patch(_Target, "method", lambda self, a, b=1: 1, "(self, a, b=1)")
    finally:
        other.restore()
    assert _Target().method(1) == 2


def test_a_stacked_patch_wraps_another_sets_and_is_restored_first(patches: PatchSet) -> None:
    original = inspect.getattr_static(_Target, "method")
    assert patches.patch(_Target, "method", lambda self, a, b=1: -a, "(self, a, b=1)")
    below = inspect.getattr_static(_Target, "method")
    recorder = PatchSet("recorder")
    assert recorder.patch(_Target, "method", lambda self, a, b=1: below(self, a, b) * 10, ["self", "a"],
                          stack=True)
    assert not recorder.patch(_Target, "method", lambda self, a, b=1: 0, stack=True)  # idempotent
    assert _Target().method(2) == -20
    assert patch_guard.installed() == {"test": [f"{__name__}._Target.method"],
                                       "recorder": [f"{__name__}._Target.method"]}
    with pytest.raises(RuntimeError, match="recorder patched over it; restore that first"):
        patches.restore()
    assert _Target().method(2) == -20  # nothing restored
    recorder.restore()
    assert inspect.getattr_static(_Target, "method") is below and patches.is_patched(_Target, "method")
    assert not recorder.is_patched(_Target, "method")
    patches.restore()
    assert inspect.getattr_static(_Target, "method") is original
    assert patch_guard.installed() == {}


def test_strict_mode_records_through_the_guard_and_restores() -> None:
    """Strict mode's recorders are one guarded patch set per step, stacked on CPU compat's
    all_to_all_single, and put every collective back when the step stops (also twice)."""
    import torch.distributed as dist

    from dualpipe_megatron.runtime.comm_log import CommLog
    from dualpipe_megatron.runtime.strict import COLLECTIVES, StepRecorder

    was_installed = cpu_compat.PATCHES.is_patched(dist, "all_to_all_single")
    cpu_compat.install_cpu_compat(["all_to_all"], force=True)
    before = {name: inspect.getattr_static(dist, name) for name in COLLECTIVES}
    recorder = StepRecorder(CommLog(0, [0, 1]))
    recorder.start()
    try:
        assert recorder.patches.labels() == [f"torch.distributed.{name}" for name in COLLECTIVES]
        assert all(inspect.getattr_static(dist, name) is not before[name] for name in COLLECTIVES)
        with pytest.raises(RuntimeError, match="strict mode patched over it"):
            cpu_compat.uninstall_cpu_compat()
        with pytest.raises(RuntimeError, match="inside another one"):
            StepRecorder(CommLog(0, [0, 1])).start()
    finally:
        recorder.stop()
    recorder.stop()
    assert {name: inspect.getattr_static(dist, name) for name in COLLECTIVES} == before
    assert cpu_compat.PATCHES.is_patched(dist, "all_to_all_single")
    assert "strict mode" not in patch_guard.installed()
    if not was_installed:
        cpu_compat.uninstall_cpu_compat()


def test_private_symbols() -> None:
    guard.check_private_symbols()  # the real table matches the installed megatron-core
    module = "megatron.core.pipeline_parallel.schedules"
    with pytest.raises(RuntimeError, match=r"_build_default_pg_collection: expected signature "
                                           r"\(pg=None\), found \(\); .*0\.19\.x"):
        guard.check_private_symbols([(module, "_build_default_pg_collection", "(pg=None)")])
    with pytest.raises(RuntimeError, match="_no_such_helper: symbol not found"):
        guard.check_private_symbols([(module, "_no_such_helper", "()")])


@pytest.fixture
def subsystems() -> Iterator[None]:
    """Every subsystem installed; all restored afterwards, whatever the test undid."""
    cpu_compat.install_cpu_compat(force=True)
    training_hooks.install()
    wgrad_megatron.install_linear_deferral()
    wgrad_te.install_delayed_wgrad_deferral()
    yield
    cpu_compat.uninstall_cpu_compat()
    training_hooks.uninstall()
    wgrad_megatron.uninstall_linear_deferral()
    wgrad_te.uninstall_delayed_wgrad_deferral()


def _samples() -> dict[str, tuple[PatchSet, object, str]]:
    """One patched symbol per subsystem: (its patch set, owner, name)."""
    from megatron.core.models.common.utils import TransformerLayerNode
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication
    from megatron.training import training

    return {
        "cpu compat": (cpu_compat.PATCHES, torch.cuda, "current_device"),
        "training": (training_hooks.PATCHES, training, "get_model"),
        "linear": (wgrad_megatron.PATCHES, LinearWithGradAccumulationAndAsyncCommunication,
                   "backward"),
        "delayed": (wgrad_te.PATCHES, TransformerLayerNode, "backward_dw"),
    }


def _state() -> dict[str, object]:
    return {key: inspect.getattr_static(owner, name)
            for key, (_, owner, name) in _samples().items()}


def test_uninstalling_one_subsystem_leaves_the_others(subsystems: None) -> None:
    installed = _state()
    for key, uninstall in (("cpu compat", cpu_compat.uninstall_cpu_compat),
                           ("linear", wgrad_megatron.uninstall_linear_deferral)):
        uninstall()
        now = _state()
        assert now[key] is not installed[key]
        patch_set, owner, name = _samples()[key]
        assert not patch_set.is_patched(owner, name) and not patch_guard.is_patched(owner, name)
        del installed[key]
        assert {k: now[k] for k in installed} == installed, f"uninstalling {key} undid others"
    for patch_set, owner, name in (_samples()[k] for k in installed):
        assert patch_set.is_patched(owner, name)


def test_installs_are_idempotent(subsystems: None) -> None:
    installed = _state()
    cpu_compat.install_cpu_compat(force=True)
    training_hooks.install()
    wgrad_megatron.install_linear_deferral()
    wgrad_te.install_delayed_wgrad_deferral()
    assert _state() == installed
    wgrad_te.uninstall_delayed_wgrad_deferral()
    before = _state()["delayed"]
    wgrad_te.uninstall_delayed_wgrad_deferral()  # a second uninstall is a no-op too
    assert _state()["delayed"] is before


class _Chunk(nn.Module):
    """Stands in for a model chunk: Megatron's ``sharded_state_dict`` signature."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        return {"weight": types.SimpleNamespace(replica_id=(0, 0, 0)), "step": 3}


def test_mirror_replicas_patch_once_and_restore() -> None:
    chunk = _Chunk()
    try:
        save_mirror_copies_as_replicas(chunk)
        save_mirror_copies_as_replicas(chunk)  # once: a second call must not add another replica
        assert chunk.sharded_state_dict()["weight"].replica_id == (1, 0, 0)
        assert MIRROR_REPLICAS.is_patched(chunk, "sharded_state_dict")
    finally:
        uninstall_mirror_replicas()
    assert "sharded_state_dict" not in vars(chunk)
    assert chunk.sharded_state_dict()["weight"].replica_id == (0, 0, 0)


TRAINING_MD = Path(__file__).resolve().parent.parent / "docs" / "training.md"


def test_the_docs_tables_are_the_guards_record(route_records: dict) -> None:
    """docs/training.md's "How it plugs into Megatron" holds the tables of a fresh record, verbatim
    (regenerate: python -m dualpipe_megatron.launch scripts/route_patches.py --write docs/training.md)."""
    assert route_patches.block(route_records) in TRAINING_MD.read_text()


def test_each_route_installs_the_same_sets_and_a_job_adds_the_rest(route_records: dict) -> None:
    assert route_records["install_for_megatron route"] == "runtime-patches"  # no extension point here
    runtime = list(route_records["runtime patches"])
    added = [name for name in route_records["job"] if name not in runtime]
    assert (runtime, list(route_records["install_for_megatron"]), list(route_records["launcher"]), added) == (
        ["stage predicates", "training flag support"], runtime, ["CPU compat", *runtime],
        ["linear weight-grad deferral", "delayed-wgrad deferral", "MTP metrics", "EPLB", "strict mode"])


def test_uninstalling_the_routes_leaves_no_patch(route_records: dict) -> None:
    assert route_records["uninstalled"] == {}
    assert route_records["job uninstalled"] == {}
