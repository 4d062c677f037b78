"""What Megatron-Bridge's ``pretrain()`` needs beside Megatron's own compatibility layer.

- Bridge's ``initialize_megatron`` calls Megatron's ``compile_helpers`` through its own binding,
  which would run ``make`` where the megatron-core wheel ships no Makefile: it gets the
  ``dataset_helpers`` group's replacement (any device).
- Without CUDA: Megatron's CPU layer (with its TE fallbacks: Bridge imports Transformer Engine),
  and Bridge's ``setup`` calls its ``initialize_megatron`` without ``allow_no_cuda`` (a CUDA
  assert, and no model-parallel RNG seeding without a device): its binding gets the wrapper
  Megatron's ``pretrain()`` gets.
"""

from __future__ import annotations

import torch

from ..megatron.cpu_compat import initializing_without_cuda, install_cpu_compat
from ..patch_guard import PatchSet
from .version import check_bridge_version

PATCHES = PatchSet("Bridge compat")
_INITIALIZE_MEGATRON = ("(cfg, allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
                        "get_position_embedding_ranks=None, restart_store=None)")


def install_bridge_compat() -> None:
    """Install before ``pretrain()`` in every process (idempotent)."""
    check_bridge_version()
    install_cpu_compat(["dataset_helpers"], force=True)
    from megatron.bridge.training import initialize, setup
    from megatron.core.datasets import utils as dataset_utils

    if not PATCHES.is_patched(initialize, "compile_helpers"):
        PATCHES.patch(initialize, "compile_helpers", dataset_utils.compile_helpers, "()")
    if torch.cuda.is_available():
        return
    install_cpu_compat()
    if not PATCHES.is_patched(setup, "initialize_megatron"):
        PATCHES.patch(setup, "initialize_megatron", initializing_without_cuda(setup.initialize_megatron),
                      _INITIALIZE_MEGATRON)


__all__ = ["PATCHES", "install_bridge_compat"]
