"""Where replica gradients enter Megatron's gradient path: before any data-parallel reduction.

Megatron reduces gradients over data parallel in up to three places; each must see an owner's
gradient with its replicas' already added (:class:`.replicas.LayerReplicas` sends them):

- ``config.finalize_model_grads_func`` (every schedule; without ``--overlap-grad-reduce`` the
  reduction starts here): wrapped to send every replica gradient not sent yet this step;
- ``config.grad_sync_func`` (with ``--overlap-grad-reduce``: Megatron's schedules and ours call it
  per model chunk once the chunk's backward is done): wrapped to send the replicas of the layers
  among the parameters it is given first;
- our DualPipe schedules' step end (a step-end action on the job, ``megatron/job.py``), before
  they sum DualPipe's mirrored copies (and tied embeddings): each copy's replicas go to that
  copy's owners first;
- DDP's per-parameter "grad ready" hook (with ``--overlap-grad-reduce``), which launches a bucket
  group's reduction as soon as the last micro-batch's gradients are in, before any replica's
  could arrive: the expert bucket groups ignore it, so they reduce when the two calls above start
  them (Megatron's first-iteration behaviour, kept for every iteration).

Each is a wrapper on a config attribute, a step-end action, or (the grad-ready hold) a guarded
instance patch of a bucket group (:data:`BUCKET_PATCHES`); :func:`forget_gradient_sources` undoes
the last two. None is a patch of Megatron's code.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..megatron.job import DualPipeJob, StepEndAction
from ..patch_guard import PatchSet

BUCKET_PATCHES = PatchSet("EPLB expert bucket hold")

# Sends replica gradients of the layers whose parameters are in the given ids (None: all layers)
# that were not sent yet this step.
Reduce = Callable[[set[int] | None], None]


def _ignore_grad_ready(param: torch.nn.Parameter, force_all_reduce: bool | None = False) -> None:
    """An expert bucket group's ``register_grad_ready``: never launch from a gradient hook."""


def hold_expert_buckets(model: list[torch.nn.Module]) -> int:
    """With ``--overlap-grad-reduce``, keep DDP's expert bucket groups from reducing on their own;
    returns how many groups that concerns."""
    held = 0
    for chunk in model:
        config = getattr(chunk, "ddp_config", None)
        if config is None or not config.overlap_grad_reduce:
            continue
        for group in chunk.expert_parallel_bucket_groups:
            BUCKET_PATCHES.patch(group, "register_grad_ready", _ignore_grad_ready, "(param, force_all_reduce=False)")
            held += 1
    return held


def _wrapped(func: Callable, reduce: Reduce) -> Callable:
    inner = getattr(func, "eplb_inner", func)  # a job's second controller replaces the first's wrapper

    def grad_sync_with_replicas(params: Iterable[torch.nn.Parameter]) -> Any:
        params = list(params)
        reduce({id(p) for p in params})
        return inner(params)

    grad_sync_with_replicas.eplb_inner = inner  # type: ignore[attr-defined]
    return grad_sync_with_replicas


def wrap_gradient_path(config: Any, reduce: Reduce, job: DualPipeJob | None) -> StepEndAction | None:
    """Wrap ``config``'s finalize and grad-sync functions so that ``reduce`` runs first and, under
    our schedules (``job``), run it first at the end of the job's steps; returns that step-end
    action (None without a job), for :func:`forget_gradient_sources`."""
    BUCKET_PATCHES.restore()
    action = None
    if job is not None:
        def before_sums(chunks: list[torch.nn.Module]) -> None:
            reduce({id(p) for chunk in chunks for p in chunk.parameters()})

        job.add_step_end(before_sums)
        action = before_sums
    finalize = config.finalize_model_grads_func
    if finalize is None:
        raise RuntimeError("EPLB redundant experts: Megatron set no finalize_model_grads_func")
    inner = getattr(finalize, "eplb_inner", finalize)

    def finalize_with_replicas(*args: Any, **kwargs: Any) -> Any:
        reduce(None)
        return inner(*args, **kwargs)

    finalize_with_replicas.eplb_inner = inner  # type: ignore[attr-defined]
    config.finalize_model_grads_func = finalize_with_replicas
    sync = config.grad_sync_func
    if isinstance(sync, list):
        config.grad_sync_func = [_wrapped(func, reduce) for func in sync]
    elif sync is not None:
        config.grad_sync_func = _wrapped(sync, reduce)
    return action


def forget_gradient_sources(job: DualPipeJob | None, action: StepEndAction | None) -> None:
    """Take ``action`` (what :func:`wrap_gradient_path` returned) off ``job``'s step end and let
    DDP's expert bucket groups launch from their grad-ready hooks again (EPLB uninstalled)."""
    BUCKET_PATCHES.restore()
    if job is not None and action is not None:
        job.remove_step_end(action)


__all__ = ["BUCKET_PATCHES", "forget_gradient_sources", "hold_expert_buckets", "wrap_gradient_path"]
