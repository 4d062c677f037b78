"""Overlapped F&B for MoE models: one FB op runs layer by layer through Megatron's schedule plans.

Megatron-Core splits each transformer layer of a ``GPTModel`` into schedule nodes
(attention, dispatch, experts, combine; ``GPTModel.build_schedule_plan``) and
``TransformerModelChunkSchedulePlan.run(f_plan, b_plan, b_grad)`` interleaves the
forward of one micro-batch with the backward of another, layer ``i`` forward with
layer ``n-1-i`` backward, putting the expert-parallel dispatch/combine all-to-alls
on a communication stream while attention/MLP run on the compute stream.
``combined_forward_backward_step`` wraps that with Megatron's forward and backward
step contracts (input tensors, first-micro-batch flag, loss node, grad scaling,
``forward_step_calc_loss``). We reuse all three unchanged: an FB op of our
schedules calls ``combined_forward_backward_step`` with the F half's chunk as
``f_model`` and the B half's chunk as ``b_model`` (two chunks, or one chunk twice).

Every forward whose backward may be overlapped must come from a plan (a plan's
output is linked to its input only through the plan's own nodes), so while the
overlap is on *every* training forward of a chunk is a plan: a lone F is
``combined_forward_backward_step`` with no ``b_model``. A lone B (the executor
backpropagates the stage output with autograd) reaches the plan through a small
autograd boundary on the stage output, whose backward is
``combined_forward_backward_step`` with no ``f_model``. Forward-only steps use
the plain path.

Eligible: training steps of MoE models with expert parallelism > 1 and the
``alltoall`` or ``flex`` dispatcher, whose ``forward_step_func`` accepts
``return_schedule_plan`` (Megatron's own convention) and whose chunks have
``build_schedule_plan``. Everything else (dense models, EP = 1) runs F then B.
``DualPipeOptions.moe_overlap = False`` turns it off.

Dense layers of an MoE model (``--moe-layer-freq``, e.g. dense-then-MoE) run in the
same plans: Megatron builds a dense layer's dispatch and combine as no-op nodes, so
its attention and MLP are compute only, and the other half's all-to-alls overlap
them. A chunk of only dense layers runs its plans too: its F paired with an MoE
chunk's B still hides that B's all-to-alls, which F then B would expose. The one
exception is in :func:`~.support.overlap_blockers`: the plans apply the final
layernorm in an MoE layer's combine node only, so a model whose last decoder layer
is dense runs F then B. The first step's announcement on global rank 0 names which
layers of its chunks overlapped their all-to-alls and which are compute only.

Megatron's flag ``overlap_moe_expert_parallel_comm`` is not needed: it only
selects Megatron's combined 1F1B schedule, and under our schedules it is accepted
as asking for this overlap (Megatron requires it for ``delay_wgrad_compute``, see
:mod:`.wgrad_te`). Megatron requires bf16/fp16 for it; our path has no such
requirement (on CPU the streams and events are stand-ins from :mod:`.cpu_compat`
and the plans run in program order).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn


from ..schedules import FB, Key, Op
from .predicates import running_chunk
from .stages import MegatronStage, MegatronStep
from .support import overlap_blockers

_said: set[str] = set()  # messages printed once per process
_layers: list[str] = []  # this rank's chunk layers (describe_layers), until announced
_HOW = {True: "MoE (EP all-to-all overlapped)", False: "dense (compute only)"}


def overlap_enabled(enabled: bool, config: Any, chunks: Sequence[nn.Module], forward_step_func: Callable,
                    forward_only: bool) -> bool:
    """Whether this step's FB ops run overlapped; warns once when asked for but not possible."""
    if not enabled or forward_only:
        return False
    reasons = overlap_blockers(config, chunks, forward_step_func)
    if reasons and getattr(config, "num_moe_experts", None):
        message = "; ".join(reasons)
        if message not in _said:
            _said.add(message)
            warnings.warn(f"DualPipe MoE F&B overlap off, running F then B: {message}", stacklevel=3)
    if not reasons and "overlap on" not in _said and _global_rank_0():
        _layers[:] = [describe_layers(chunks)]
    return not reasons


def _global_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def describe_layers(chunks: Sequence[nn.Module]) -> str:
    """How the plans run each decoder (and MTP) layer of ``chunks``, by Megatron's layer numbers, e.g.
    ``chunk 0: layer 1 dense (compute only), layer 2 MoE (EP all-to-all overlapped)``; MoE or
    not by the plans' own test (the layer's MLP is an ``MoELayer``, as ``--moe-layer-freq`` built it)."""
    from megatron.core.models.common.fine_grained_callables import get_layer_moe_metadata
    from megatron.core.utils import get_attr_wrapped_model

    parts = []
    for c, chunk in enumerate(chunks):
        try:
            layers = get_attr_wrapped_model(chunk, "decoder").layers
        except RuntimeError:  # not a GPT chunk: nothing to name
            layers = []
        runs: list[list] = []  # [is MoE, first, last layer number] of consecutive layers
        for layer in layers:
            moe, number = get_layer_moe_metadata(layer)[0], layer.layer_number
            if runs and runs[-1][0] == moe and runs[-1][2] == number - 1:
                runs[-1][2] = number
            else:
                runs.append([moe, number, number])
        named = [f"layer {a} {_HOW[moe]}" if a == b else f"layers {a}-{b} {_HOW[moe]}" for moe, a, b in runs]
        try:  # the MTP block (--mtp-num-layers) runs in the loss stage's plans too
            mtp_layers = get_attr_wrapped_model(chunk, "mtp").layers
        except RuntimeError:
            mtp_layers = []
        named += [f"MTP layer {k} {_HOW[get_layer_moe_metadata(layer.mtp_model_layer)[0]]}"
                  for k, layer in enumerate(mtp_layers, 1)]
        parts.append(f"chunk {c}: {', '.join(named) or 'no decoder layers'}")
    return "; ".join(parts)


def announce_overlap(overlapped: int, deferred: int, rank_ops: Sequence[Op]) -> None:
    """Say once per process, on global rank 0, how many of this rank's FB ops ran overlapped, how
    many weight-grad closures its W ops ran (the W split inside the plans), and what ran how in
    each chunk (the counterpart of the warning above, so a log shows which way a run went)."""
    if "overlap on" in _said or not _global_rank_0():
        return
    _said.add("overlap on")
    fb_ops = sum(isinstance(op, FB) for op in rank_ops)
    layers = _layers.pop() if _layers else ""
    print(f"DualPipe MoE F&B overlap on: {overlapped} of {fb_ops} FB ops on this rank ran through "
          f"Megatron's combined_forward_backward_step, and its W ops ran {deferred} deferred weight-grad "
          f"closures" + (f"; {layers}" if layers else ""), flush=True)


class _Pending:
    """A plan-built forward waiting for its backward: what ``combined_forward_backward_step``
    needs as ``b_model``/``b_input_tensor``/``b_output_tensor``."""

    __slots__ = ("stage", "inputs", "output", "is_last")

    def __init__(self, stage: "MoEOverlapStage", inputs: list[torch.Tensor], output: torch.Tensor,
                 is_last: bool) -> None:
        self.stage, self.inputs, self.output, self.is_last = stage, inputs, output, is_last

    def b_args(self, grad: torch.Tensor | None) -> dict[str, Any]:
        """Keyword arguments of the B half; ``grad`` is ignored on the last stage, where Megatron
        backpropagates the (grad-scaled) loss itself."""
        step = self.stage.step
        pending, self.output = self.output, None  # one backward per forward
        if pending is None:
            raise RuntimeError(f"{self.stage.describe()}: backward of a plan-built forward ran twice")
        return dict(
            b_model=step.model[self.stage.chunk],
            b_input_tensor=list(self.inputs) if self.inputs else None,
            b_output_tensor=[pending],
            b_output_tensor_grad=[None if self.is_last else grad],
        )


class _PlanBoundary(torch.autograd.Function):
    """A plan's output (an alias) whose backward runs the plan's backward (a lone B).

    The output is not an autograd input here: the outer backward must not walk into the
    plan's graph, which the plan's own backward has already consumed. ``anchor`` (an empty
    leaf) only makes the alias require grad.
    """

    @staticmethod
    def forward(ctx: Any, pending: _Pending, anchor: torch.Tensor) -> torch.Tensor:
        ctx.pending = pending
        return pending.output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        pending, ctx.pending = ctx.pending, None
        # Autograd runs backward functions with grad mode off; Megatron's B half builds a graph
        # (the grad-scaled loss) before it backpropagates.
        with torch.enable_grad():
            MoEOverlapStage._combined(None, None, pending, grad)
        return None, None


def _pending_of(tensor: torch.Tensor) -> _Pending:
    pending = getattr(tensor, "_dualpipe_moe_pending", None)
    if pending is None:
        raise RuntimeError("overlapped F&B: the B half's output was not built by a schedule plan "
                           "(every training forward must go through MoEOverlapStage)")
    return pending


class MoEOverlapStage(MegatronStage):
    """A stage whose training forwards are Megatron schedule plans; an FB op of two such stages
    runs through :meth:`overlapped_forward_backward` (the executor's DeepSeek-style hook)."""

    def __call__(self, *inputs: torch.Tensor, key: Key) -> torch.Tensor:
        return self._combined(self, list(inputs), None, None, key)

    @staticmethod
    def overlapped_forward_backward(
        module0: "MoEOverlapStage", inputs0: list[torch.Tensor], criterion0: Callable | None,
        labels0: list[Any], module1: "MoEOverlapStage", loss1: torch.Tensor | None,
        outputs1: list[torch.Tensor], output_grads1: list[torch.Tensor], key0: Key,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """F of ``module0`` on ``inputs0`` (op key ``key0``) together with B of ``module1`` (DeepSeek's hook)."""
        if loss1 is not None:
            pending, grad = _pending_of(loss1), None
        else:
            if len(outputs1) != 1 or len(output_grads1) != 1:
                raise RuntimeError(f"{module1.describe()}: expected one output and one grad, got "
                                   f"{len(outputs1)} and {len(output_grads1)}")
            pending, grad = _pending_of(outputs1[0]), output_grads1[0]
        if pending.stage is not module1:
            raise RuntimeError(f"B half of {module1.describe()} got an output of {pending.stage.describe()}")
        outputs0 = MoEOverlapStage._combined(module0, list(inputs0), pending, grad, key0)
        loss0 = criterion0(outputs0, *labels0) if criterion0 is not None else None
        return outputs0, loss0

    @staticmethod
    def _combined(f: "MoEOverlapStage | None", f_inputs: list[torch.Tensor] | None,
                  b: _Pending | None, b_grad: torch.Tensor | None, key: Key | None = None) -> torch.Tensor | None:
        """One ``combined_forward_backward_step``: F of stage ``f`` for op ``key`` (if any) with B of
        ``b`` (if any).

        Returns F's stage output (on the last stage: the loss) behind a :class:`_PlanBoundary`.
        """
        from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
        from megatron.core.pipeline_parallel.utils import set_streams

        owner = f if f is not None else b.stage
        step: MegatronStep = owner.step
        config = step.config
        set_streams(high_priority=getattr(config, "high_priority_a2a_comm_stream", False))
        kwargs: dict[str, Any] = dict(b_model=None, b_input_tensor=None, b_output_tensor=None,
                                      b_output_tensor_grad=None)
        if b is not None:
            kwargs.update(b.b_args(b_grad))
        if f is None:
            combined_forward_backward_step(
                step.forward_step_func, None, None, step.num_microbatches, None, [], config=config,
                **kwargs)
            return None

        reader, global_m, first = f.forward_args(key)
        with running_chunk(f.chunk):
            output, num_tokens, _ = combined_forward_backward_step(
                step.forward_step_func, reader, step.model[f.chunk],
                step.num_microbatches, f_inputs[0] if f_inputs else None,
                step.store_for(f.d, key.m), config=config, f_model_chunk_id=f.chunk,
                is_first_microbatch=first, current_microbatch=global_m, **kwargs,
            )
        if f.is_last:
            step.num_tokens += num_tokens
        pending = _Pending(f, f_inputs, output, f.is_last)
        alias = _PlanBoundary.apply(pending, torch.empty(0, requires_grad=True))
        if not f.is_last and output._base is None:
            # The plan's backward needs its output's graph, not its values: leave the storage to
            # the alias alone, so the executor's release after the send really frees it.
            output.data = torch.empty((1,), dtype=output.dtype, device=output.device)
        alias._dualpipe_moe_pending = pending
        return alias


__all__ = ["MoEOverlapStage", "announce_overlap", "describe_layers", "overlap_enabled"]
