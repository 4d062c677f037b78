"""Weight-gradient deferral for Megatron's local linear layers.

Megatron's ``ColumnParallelLinear``/``RowParallelLinear`` (attention projections, dense MLPs,
``SequentialMLP`` experts, the output layer) all run through
``LinearWithGradAccumulationAndAsyncCommunication``, whose backward computes the input grad
and the weight grad together. While the runtime's :class:`WeightGradStore` is enabled (a
schedule's ``B`` with ``w:false``) the patched backward computes the input grad (and the cheap
bias grad) now and files the weight-grad GEMM for the matching ``W``, which accumulates into
``main_grad`` under Megatron DDP (as DDP's grad hook would) or into ``.grad`` otherwise.
Outside a deferred backward the original runs unchanged.

Under sequence parallelism the deferred backward all-gathers the input's sequence shards at
``B``, in the order Megatron's backward issues its collectives (all-gather, then the input
grad's reduce-scatter), into a tensor of its own that the filed GEMM keeps until ``W``: the
full-sequence input stays alive between ``B`` and ``W`` (Megatron's shared all-gather buffer
would be overwritten by then). The first such backward says so once, on global rank 0.

Not deferred (they fall back to the full backward): Megatron's own ``wgrad_deferral_limit``
buffers and GTP weight re-materialisation. Transformer Engine layers defer through Megatron's
``delay_wgrad_compute`` instead (:mod:`.wgrad_te`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..patch_guard import PatchSet
from ..runtime.wgrad import WeightGradStore
from .guard import check_version

PATCHES = PatchSet("linear weight-grad deferral")
# The full signature pins the ten inputs ``_backward`` returns a grad (or None) for.
_FORWARD = ("(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, "
            "sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group, gtp_remat_size)")
_original: dict[str, Callable] = {}
_zeros: dict[tuple, torch.Tensor] = {}
_said: set[str] = set()


def _placeholder_grad(weight: torch.Tensor, fusion: bool) -> torch.Tensor | None:
    """What the deferred B hands autograd for the weight.

    Megatron DDP's grad hook fires on every backward and, with overlapped reduction, insists on
    a grad; a shared zero tensor adds nothing to ``main_grad``. Under gradient-accumulation
    fusion Megatron itself flags the grad as already in ``main_grad``; we do the same.
    """
    if not hasattr(weight, "main_grad"):
        return None
    if fusion:
        weight.grad_added_to_main_grad = True
    key = (tuple(weight.shape), weight.dtype, weight.device)
    if key not in _zeros:
        _zeros[key] = torch.zeros(key[0], dtype=key[1], device=key[2])
    return _zeros[key]


def _accumulate(weight: torch.Tensor, grad: torch.Tensor) -> None:
    """Where the full backward's weight grad would have ended up."""
    if hasattr(weight, "main_grad"):  # Megatron DDP: its grad hook adds .grad into main_grad
        weight.main_grad.add_(grad)
    elif weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


@torch.no_grad()  # as inside autograd's backward, where this work would otherwise run
def _weight_grad(weight: torch.Tensor, grad_2d: torch.Tensor, input_2d: torch.Tensor,
                 fusion: bool) -> None:
    """The deferred GEMM, with the kernel the full backward would have used."""
    if fusion:
        from megatron.core.tensor_parallel import layers

        kernel = (layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32
                  if weight.main_grad.dtype == torch.float32
                  else layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16)
        kernel(input_2d, grad_2d, weight.main_grad)
        return
    _accumulate(weight, grad_2d.t().matmul(input_2d))


def _deferrable(ctx: Any) -> bool:
    return WeightGradStore.enabled and ctx.grad_output_buffer is None and ctx.gtp_remat_size <= 1


def _gathered(shard: torch.Tensor, group: Any) -> torch.Tensor:
    """The full sequence (dim 0) of every TP rank's shard, in a tensor that outlives this backward."""
    full = shard.new_empty((shard.shape[0] * group.size(), *shard.shape[1:]))
    torch.distributed.all_gather_into_tensor(full, shard.contiguous(), group=group)
    return full


def _scattered(full: torch.Tensor, group: Any) -> torch.Tensor:
    """This TP rank's sequence shard of the sum of every rank's ``full`` (the input grad under SP)."""
    shard = full.new_empty((full.shape[0] // group.size(), *full.shape[1:]))
    torch.distributed.reduce_scatter_tensor(shard, full.contiguous(), group=group)
    return shard


def _announce_sequence_parallel() -> None:
    """Say once per process, on global rank 0, that SP linears defer (and what that keeps alive)."""
    if "sp" in _said or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    _said.add("sp")
    print("DualPipe weight-grad split: sequence-parallel linears defer their weight grads to W, "
          "each keeping its all-gathered input from B until then", flush=True)


def _forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
    """The original forward; keeps the parameter itself for a deferred backward.

    Under saved-tensor hooks (activation offloading, memory meters) ``ctx.saved_tensors`` hands
    back new tensor objects: a weight grad accumulated into one of those would be lost.
    """
    ctx.dualpipe_weight = weight
    return _original["forward"](ctx, input, weight, *args)


def _backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
    if not _deferrable(ctx):
        return _original["backward"](ctx, grad_output)
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    input, saved_weight = ctx.saved_tensors
    weight = ctx.dualpipe_weight
    if ctx.gradient_accumulation_fusion:
        weight.main_grad = ctx.main_grad
    if ctx.sequence_parallel:
        _announce_sequence_parallel()
        input = _gathered(input, ctx.tp_group)
    grad_input = grad_output.matmul(saved_weight)
    if ctx.sequence_parallel:
        grad_input = _scattered(grad_input, ctx.tp_group)
    handle = (torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
              if ctx.allreduce_dgrad else None)
    grad_2d, input_2d = prepare_input_tensors_for_wgrad_compute(grad_output, input)
    WeightGradStore.put(lambda: _weight_grad(weight, grad_2d, input_2d, ctx.gradient_accumulation_fusion))
    grad_bias = grad_2d.sum(dim=0) if ctx.use_bias else None
    if handle is not None:
        handle.wait()
    return grad_input, _placeholder_grad(weight, ctx.gradient_accumulation_fusion), grad_bias, \
        None, None, None, None, None, None, None


def install_linear_deferral() -> None:
    """Patch the linear autograd function's forward and backward (once; guarded like every patch)."""
    check_version()
    from megatron.core.tensor_parallel import layers

    owner = layers.LinearWithGradAccumulationAndAsyncCommunication
    forward, backward = owner.forward, owner.backward
    if PATCHES.patch(owner, "forward", _forward, _FORWARD):
        _original["forward"] = forward
    if PATCHES.patch(owner, "backward", layers.custom_bwd(_backward), "(ctx, grad_output)"):
        _original["backward"] = backward


def uninstall_linear_deferral() -> None:
    """Put Megatron's own forward and backward back."""
    PATCHES.restore()
    _original.clear()


__all__ = ["PATCHES", "install_linear_deferral", "uninstall_linear_deferral"]
