"""The entry point that enables ``--pipeline-schedule`` and the ``--eplb-*`` flags in a process.

It composes the Megatron adapter's route (the schedule plugin where megatron carries the
extension point of patches/, else :func:`training_support.install`'s runtime patches) with
EPLB's flag registration. It sits above both sub-packages because EPLB registers its flags
through the adapter's argument hooks: the adapter cannot import EPLB's entry point back without
an import cycle. docs/training.md ("What each route patches") lists what each route installs.
"""

from __future__ import annotations

from .eplb import training as eplb_training
from .megatron import predicates, training_support, upstream_plugin


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
    """Undo the runtime patches :func:`install_for_megatron` and its hooks installed: EPLB's,
    the training flag's and the stage predicates, whose job stage map is cleared (tests and
    diagnosis). A registered plugin
    stays registered: the extension point cannot remove one."""
    eplb_training.uninstall()
    training_support.uninstall()
    predicates.set_job_stage_map(None)
    predicates.PATCHES.restore()


__all__ = ["install_for_megatron", "uninstall_for_megatron"]
