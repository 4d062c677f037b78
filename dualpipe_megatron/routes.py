"""The entry point that enables ``--pipeline-schedule`` and the ``--eplb-*`` flags in a process.

It composes the Megatron adapter's route (the schedule plugin where megatron carries the
extension point of patches/, else :func:`training_support.install`'s runtime patches) with
EPLB's flag registration. It sits above both sub-packages because EPLB registers its flags
through the adapter's argument hooks: the adapter cannot import EPLB's entry point back without
an import cycle. docs/training.md ("What each route patches") lists what each route installs,
as the guard records it (``patch_guard.installed()``).
"""

from __future__ import annotations

from .eplb import training as eplb_training
from .megatron import model, mtp, predicates, training_support, upstream_plugin, wgrad_megatron, wgrad_te


def install_for_megatron() -> str:
    """Enable ``--pipeline-schedule`` the least invasive way this megatron allows: the plugin
    where the extension point exists, else runtime patches; and the ``--eplb-*`` flags (EPLB's
    own runtime patches follow, either way, only when one is set). Returns ``"plugin"`` or
    ``"runtime-patches"``. Call it before Megatron parses its arguments."""
    eplb_training.install()
    if upstream_plugin.has_extension_point():
        upstream_plugin.register()
        return "plugin"
    training_support.install()
    return "runtime-patches"


def uninstall_for_megatron() -> None:
    """Undo every runtime patch :func:`install_for_megatron` and the jobs it enabled installed:
    EPLB's, the training flag's, the stage predicates (their job stage map cleared) and what
    building and stepping a model added (weight-grad deferrals, mirror replicas, MTP metrics).
    For tests and diagnosis: a model built meanwhile no longer runs under our schedules. CPU
    compat has its own ``uninstall_cpu_compat``; strict mode restores its recorders at each
    step's end. A registered plugin stays registered: the extension point cannot remove one."""
    eplb_training.uninstall()
    training_support.uninstall()
    predicates.set_job_stage_map(None)
    predicates.PATCHES.restore()
    wgrad_megatron.uninstall_linear_deferral()
    wgrad_te.uninstall_delayed_wgrad_deferral()
    model.uninstall_mirror_replicas()
    mtp.PATCHES.restore()


__all__ = ["install_for_megatron", "uninstall_for_megatron"]
