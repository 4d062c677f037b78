"""The CPU-compat layer itself: idempotent, switchable, restorable, and loud on drift."""

from __future__ import annotations

import importlib
import importlib.metadata
import types
from collections.abc import Iterator

import pytest
import torch

from dualpipe_megatron import patch_guard
from dualpipe_megatron.megatron import cpu_compat, guard
from dualpipe_megatron.megatron.cpu_compat import DISABLE_ENV, GROUPS, install_cpu_compat

pytestmark = pytest.mark.unit


@pytest.fixture
def restore(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Patches are process-wide: undo them so later tests see plain torch."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    yield
    cpu_compat.uninstall_cpu_compat()


def _samples() -> dict[str, object]:
    """One symbol per group, as seen now (class attributes via the class dict)."""
    import torch._dynamo
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.training import arguments

    return {
        "current_device": torch.cuda.current_device,
        "Stream": torch.cuda.Stream,
        "set_cuda_rng_state": mrandom._set_cuda_rng_state,
        "zeros": torch.zeros,
        "Tensor.to": vars(torch.Tensor).get("to"),
        "Tensor.type": vars(torch.Tensor).get("type"),
        "all_to_all_single": torch.distributed.all_to_all_single,
        "dynamo disable": torch._dynamo.config.disable,
        "compile_helpers": dataset_utils.compile_helpers,
        "WrappedTorchNorm.__new__": vars(WrappedTorchNorm).get("__new__"),
        "MultiLatentAttention.__init__": vars(MultiLatentAttention).get("__init__"),
        "get_device_arch_version": arguments.get_device_arch_version,
    }


def test_install_is_idempotent_and_restorable(restore: None) -> None:
    before = _samples()
    installed = install_cpu_compat(force=True)
    assert installed == list(GROUPS)
    patched = _samples()
    assert all(patched[k] is not before[k] for k in before), "every sample symbol is patched"
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(1).cuda().type() == "torch.cuda.FloatTensor"
    assert torch.cuda.device_count() == 0, "a GPU is claimed only inside initialize_megatron"

    assert install_cpu_compat(force=True) == installed
    assert _samples() == patched, "a second install changes nothing"

    cpu_compat.uninstall_cpu_compat()
    assert _samples() == before
    assert cpu_compat.installed_groups() == []


def test_env_var_and_argument_select_groups(
    restore: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DISABLE_ENV, "rng, streams")
    installed = install_cpu_compat(["device", "rng", "streams", "compile"], force=True)
    assert installed == ["device", "compile"]
    assert patch_guard.is_patched(torch.cuda, "current_device")
    assert not patch_guard.is_patched(torch.cuda, "get_rng_state")
    assert not patch_guard.is_patched(torch.cuda, "Stream")
    assert not patch_guard.is_patched(torch, "zeros")


def test_env_var_all_disables_everything(restore: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DISABLE_ENV, "all")
    assert install_cpu_compat(force=True) == []


def test_unknown_group_names_fail(restore: None, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown CPU-compat group"):
        install_cpu_compat(["no_such_group"], force=True)
    monkeypatch.setenv(DISABLE_ENV, "rgn")
    with pytest.raises(ValueError, match="rgn"):
        install_cpu_compat(force=True)


def test_guard_rejects_changed_or_missing_symbols(restore: None) -> None:
    def f(x: int, y: int) -> int:
        return x

    fake = types.SimpleNamespace(f=f)
    patches = patch_guard.PatchSet("test")
    with pytest.raises(RuntimeError, match=r"expected parameters \['a', 'b'\], found \['x', 'y'\]"):
        patches.patch(fake, "f", lambda a, b: a, ["a", "b"])
    assert fake.f is f
    with pytest.raises(RuntimeError, match="not found"):
        patches.patch(fake, "g", lambda: None, [])

    assert patches.patch(fake, "f", lambda x, y: y, ["x"])
    assert not patches.patch(fake, "f", lambda x, y: 0, ["x"]), "second patch is a no-op"
    assert fake.f(1, 2) == 2
    patches.restore()
    assert fake.f is f


def test_version_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The imported megatron's own version decides; the metadata only where none is found."""
    monkeypatch.setattr(patch_guard, "imported_megatron_version", lambda: "0.19.7+abc")
    assert guard.check_version() == "0.19.7+abc"
    monkeypatch.setattr(patch_guard, "imported_megatron_version", lambda: "0.20.0")
    with pytest.raises(RuntimeError, match="0.20.0 is not supported"):
        guard.check_version()
    monkeypatch.setattr(patch_guard, "imported_megatron_version", lambda: None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.3")
    assert guard.check_version() == "0.19.3"


def test_version_mismatch_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.2")
    monkeypatch.setattr(patch_guard, "imported_megatron_version", lambda: "0.19.2+a4ca137")
    assert patch_guard.megatron_version_mismatch() is None  # a git hash is not another release
    monkeypatch.setattr(patch_guard, "imported_megatron_version", lambda: "0.19.9")
    line = patch_guard.megatron_version_mismatch()
    assert "megatron-core 0.19.2 is installed" in line and "against 0.19.9" in line, line


def test_dataset_helpers_use_the_built_module_else_megatrons_build(
    restore: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wheel ships helpers_cpp built but no Makefile: compile_helpers imports it (GPU jobs
    too, where scripts/pretrain_gpt.py forces this group) and builds only where it is missing."""
    from megatron.core.datasets import utils as dataset_utils

    builds: list[bool] = []
    monkeypatch.setattr(dataset_utils, "compile_helpers", lambda: builds.append(True))
    assert install_cpu_compat(["dataset_helpers"], force=True) == ["dataset_helpers"]
    dataset_utils.compile_helpers()
    assert builds == []

    real = importlib.import_module

    def without_helpers(name: str, *args: object) -> types.ModuleType:
        if name.endswith("helpers_cpp"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_helpers)
    dataset_utils.compile_helpers()
    assert builds == [True]
