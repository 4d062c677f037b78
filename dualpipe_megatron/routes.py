"""The entry point that enables ``--pipeline-schedule`` and the ``--eplb-*`` flags in a process.

It composes the Megatron adapter's route (the schedule plugin where megatron carries the
extension point of patches/, else :func:`training_hooks.install`'s runtime patches) with
EPLB's flag registration. It sits above both sub-packages because EPLB registers its flags
through the adapter's argument hooks: the adapter cannot import EPLB's entry point back without
an import cycle. docs/training.md ("How it plugs into Megatron") lists what each route installs,
as the guard records it (``patch_guard.installed()``; scripts/route_patches.py writes the tables).
"""

from __future__ import annotations

import os

from .eplb import training as eplb_training
from .megatron import model, mtp, predicates, training_hooks, upstream_plugin, wgrad_megatron, wgrad_te
from .megatron.cpu_compat import install_cpu_compat
from .patch_guard import megatron_version_mismatch

MOCK_DOCUMENTS_ENV = "DUALPIPE_MOCK_DOCUMENTS"


def install_for_megatron() -> str:
    """Enable ``--pipeline-schedule`` the least invasive way this megatron allows: the plugin
    where the extension point exists, else runtime patches; and the ``--eplb-*`` flags (EPLB's
    own runtime patches follow, either way, only when one is set). Returns ``"plugin"`` or
    ``"runtime-patches"``. Call it before Megatron parses its arguments."""
    eplb_training.install()
    if upstream_plugin.has_extension_point():
        upstream_plugin.register()
        return "plugin"
    training_hooks.install()
    return "runtime-patches"


def install_for_training() -> str:
    """What every entry point that starts a Megatron training process installs, the same on
    each (``python -m dualpipe_megatron.launch``, ``scripts/pretrain_gpt.py``, the tests' fork
    server): says in one line when a megatron source tree shadows the installed wheel; the CPU
    compatibility layer where CUDA is absent; the ``dataset_helpers`` group on any device (the
    wheel's built index helpers, since its ``compile_helpers`` would run ``make`` where no
    Makefile is shipped); a smaller mock corpus where ``DUALPIPE_MOCK_DOCUMENTS`` asks for one;
    then :func:`install_for_megatron`. Returns the route it took."""
    mismatch = megatron_version_mismatch()
    if mismatch and os.environ.get("RANK", "0") == "0":
        print(f"dualpipe: {mismatch}", flush=True)
    install_cpu_compat()  # a no-op where CUDA exists
    install_cpu_compat(["dataset_helpers"], force=True)
    limit_mock_corpus()
    return install_for_megatron()


def limit_mock_corpus() -> None:
    """``DUALPIPE_MOCK_DOCUMENTS=N`` keeps the first N documents of Megatron's mock corpus (100,000
    random-length documents, ~200M tokens; ``--mock-data``). Indexing all of it takes ~13 s per
    rank on CPU, the larger part of a small test or demo job's start-up; such jobs need a few
    hundred samples. Unset, Megatron's corpus is untouched."""
    documents = os.environ.get(MOCK_DOCUMENTS_ENV)
    if documents:
        from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

        MockGPTLowLevelDataset.size = int(documents)


def uninstall_for_megatron() -> None:
    """Undo every runtime patch :func:`install_for_megatron` and the jobs it enabled installed:
    EPLB's, the training flag's, the stage predicates (their job stage map cleared) and what
    building and stepping a model added (weight-grad deferrals, mirror replicas, MTP metrics).
    For tests and diagnosis: a model built meanwhile no longer runs under our schedules. CPU
    compat has its own ``uninstall_cpu_compat``; strict mode restores its recorders at each
    step's end. A registered plugin stays registered: the extension point cannot remove one."""
    eplb_training.uninstall()
    training_hooks.uninstall()
    predicates.set_job_stage_map(None)
    predicates.PATCHES.restore()
    wgrad_megatron.uninstall_linear_deferral()
    wgrad_te.uninstall_delayed_wgrad_deferral()
    model.uninstall_mirror_replicas()
    mtp.PATCHES.restore()


__all__ = ["MOCK_DOCUMENTS_ENV", "install_for_megatron", "install_for_training", "limit_mock_corpus",
           "uninstall_for_megatron"]
