"""The Megatron side of the patch guard: the supported version and the private functions we call.

Megatron changes between releases, so every subsystem that patches or calls into it checks the
installed megatron-core against the one series we support first. The patching itself is
:mod:`dualpipe_megatron.patch_guard`'s, shared with the runtime and EPLB.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

from ..patch_guard import SUPPORTED, SUPPORTED_MEGATRON, check_signature, megatron_version, unsupported

# Private Megatron functions we call without patching: (module, qualname, full signature).
# Nothing else pins their shape, so check_private_symbols() checks them before use.
PRIVATE_CALLS: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.pipeline_parallel.schedules", "_build_default_pg_collection", "()"),
    # Public, but called with positional arguments whose order we rely on.
    ("megatron.core.pipeline_parallel.schedules", "check_first_val_step", "(first_val_step, forward_only, cond)"),
    ("megatron.core.pipeline_parallel.schedules", "forward_step",
     "(forward_step_func, data_iterator, model, num_microbatches, input_tensor, forward_data_store, config, "
     "cp_group_size, collect_non_loss_data=False, checkpoint_activations_microbatch=None, "
     "is_first_microbatch=False, current_microbatch=None, vp_stage=None, is_last_stage=True)"),
    ("megatron.core.pipeline_parallel.combined_1f1b", "combined_forward_backward_step",
     "(forward_step_func, data_iterator, f_model, num_microbatches, input_tensor, forward_data_store, b_model, "
     "b_input_tensor, b_output_tensor, b_output_tensor_grad, config, f_model_chunk_id=None, pre_forward=None, "
     "pre_backward=None, post_forward=None, post_backward=None, collect_non_loss_data=False, "
     "checkpoint_activations_microbatch=None, is_first_microbatch=False, current_microbatch=None, "
     "encoder_decoder_xattn=False, fsdp_wrapper=None)"),
)


def check_version() -> str:
    """Return the version of the megatron that runs (a source checkout's own, where it shadows or
    replaces a wheel), raising unless it is a 0.19.x release we support."""
    version = megatron_version()
    if version is None:
        raise RuntimeError("megatron-core is not installed and no megatron source tree is importable")
    parts = version.split("+")[0].split(".")
    if tuple(int(p) for p in parts[:2] if p.isdigit()) != SUPPORTED_MEGATRON:
        raise RuntimeError(
            f"megatron-core {version} is not supported; dualpipe_megatron patches {SUPPORTED} only"
        )
    return version


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        if not hasattr(obj, part):
            raise unsupported(f"{module}.{qualname}", "symbol not found")
        obj = getattr(obj, part)
    return obj


def check_private_symbols(calls: Sequence[tuple[str, str, str]] = PRIVATE_CALLS) -> None:
    """Check the version and every private Megatron function we call (:data:`PRIVATE_CALLS`)."""
    check_version()
    for module, qualname, signature in calls:
        check_signature(_resolve(module, qualname), signature, f"{module}.{qualname}")


__all__ = ["PRIVATE_CALLS", "check_private_symbols", "check_version"]
