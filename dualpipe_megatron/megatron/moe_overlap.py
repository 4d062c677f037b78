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
overlap is on *every* training forward of a chunk is a plan: the handlers
(:class:`MoEOverlapHandlers`) run a lone F as ``combined_forward_backward_step``
with no ``b_model``, a lone B as one with no ``f_model``, and an FB op as one
with both, each with the op's keys. Forward-only steps use the plain path.

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
exception is in :func:`~.refusals.overlap_blockers`: the plans apply the final
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

import functools
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..runtime.handlers import Forwarded
from ..schedules import B, F, FB, Key, Op
from .predicates import running_chunk
from .stages import MegatronHandlers
from .refusals import overlap_blockers

_said: set[str] = set()  # messages printed once per process
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
    return not reasons


def _global_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def layers_to_announce(chunks: Sequence[nn.Module]) -> str:
    """What :func:`announce_overlap` names after this step: :func:`describe_layers` where it will
    speak (global rank 0, not said yet), else nothing."""
    return describe_layers(chunks) if "overlap on" not in _said and _global_rank_0() else ""


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


def announce_overlap(overlapped: int, deferred: int, rank_ops: Sequence[Op], layers: str) -> None:
    """Say once per process, on global rank 0, how many of this rank's FB ops ran overlapped, how
    many weight-grad closures its W ops ran (the W split inside the plans), and what ran how in
    each chunk (``layers``, from :func:`layers_to_announce`; the counterpart of the warning above,
    so a log shows which way a run went)."""
    if "overlap on" in _said or not _global_rank_0():
        return
    _said.add("overlap on")
    fb_ops = sum(isinstance(op, FB) for op in rank_ops)
    print(f"DualPipe MoE F&B overlap on: {overlapped} of {fb_ops} FB ops on this rank ran through "
          f"Megatron's combined_forward_backward_step, and its W ops ran {deferred} deferred weight-grad "
          f"closures" + (f"; {layers}" if layers else ""), flush=True)


def asking_for_plans(forward_step_func: Callable) -> Callable:
    """The forward step as the plans call it. A script that returns schedule plans only under
    Megatron's ``--overlap-moe-expert-parallel-comm`` (Megatron-LM's ``pretrain_gpt.py`` asserts
    it) fails saying what to pass, instead of with its bare assertion."""
    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward_step_func(*args, **kwargs)
        except AssertionError as exc:
            if "overlap_moe_expert_parallel_comm" not in str(exc):
                raise
            raise RuntimeError(
                f"the MoE F&B overlap asks the forward step for schedule plans, and it refuses ({exc}): "
                f"pass --overlap-moe-expert-parallel-comm (Megatron allows it with --bf16 or --fp16), or "
                f"--no-dualpipe-moe-overlap to run F then B (Megatron-Bridge: cfg.model."
                f"overlap_moe_expert_parallel_comm = True, or enable(..., moe_overlap=False))") from exc
    return forward_step


class MoEOverlapHandlers(MegatronHandlers):
    """Handlers whose training forwards are Megatron schedule plans: every F, B and FB op is one
    ``combined_forward_backward_step`` (an FB op of any two of this rank's stages overlaps)."""

    def forward(self, key: Key, inputs: list[Any]) -> Forwarded:
        return self._combined(key, inputs, {})

    def backward(self, half: B, inputs: list[Any], loss: torch.Tensor | None, outputs: list[torch.Tensor],
                 grads: list[torch.Tensor]) -> None:
        self._combined(None, None, self._b_args(half.key, inputs, loss, outputs, grads))

    def pairs(self, f: F, b: B) -> bool:
        return True

    def pair(self, f: F, inputs0: list[Any], b: B, inputs1: list[Any], loss1: torch.Tensor | None,
             outputs1: list[torch.Tensor], grads1: list[torch.Tensor]) -> Forwarded:
        return self._combined(f.key, inputs0, self._b_args(b.key, inputs1, loss1, outputs1, grads1))

    def _b_args(self, key: Key, inputs: list[Any], loss: torch.Tensor | None, outputs: list[torch.Tensor],
                grads: list[torch.Tensor]) -> dict[str, Any]:
        """The B half's keyword arguments: the plan-built output of its F (it carries the plan) and
        the received grad; on the last stage none, Megatron backpropagates the (grad-scaled) loss."""
        if loss is not None:
            output, grad = loss, None
        elif len(outputs) != 1 or len(grads) != 1:
            raise RuntimeError(f"overlapped B of {key}: expected one output and one grad, got "
                               f"{len(outputs)} and {len(grads)}")
        else:
            output, grad = outputs[0], grads[0]
        return dict(b_model=self.step.model[self.chunk_of[(key.d, key.s)]],
                    b_input_tensor=list(inputs) if inputs else None,
                    b_output_tensor=[output], b_output_tensor_grad=[grad])

    def _combined(self, key: Key | None, f_inputs: list[Any] | None, b_args: dict[str, Any]) -> Forwarded:
        """One ``combined_forward_backward_step``: the F of ``key`` (if any) on ``f_inputs`` with the
        B that ``b_args`` describe (if any); returns F's stage output, or on the last stage its loss."""
        from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
        from megatron.core.pipeline_parallel.utils import set_streams

        step, config = self.step, self.step.config
        set_streams(high_priority=getattr(config, "high_priority_a2a_comm_stream", False))
        kwargs: dict[str, Any] = dict(b_model=None, b_input_tensor=None, b_output_tensor=None,
                                      b_output_tensor_grad=None)
        kwargs.update(b_args)
        if key is None:
            combined_forward_backward_step(
                asking_for_plans(step.forward_step_func), None, None, step.num_microbatches, None, [], config=config,
                **kwargs)
            return [], None
        chunk, reader, global_m, first = self.forward_args(key)
        with running_chunk(chunk):
            output, num_tokens, _ = combined_forward_backward_step(
                asking_for_plans(step.forward_step_func), reader, step.model[chunk],
                step.num_microbatches, f_inputs[0] if f_inputs else None,
                step.store_for(key.d, key.m), config=config, f_model_chunk_id=chunk,
                is_first_microbatch=first, current_microbatch=global_m, **kwargs,
            )
        if key.s != self.last_stage:
            return [output], None
        step.num_tokens += num_tokens
        return [], output


__all__ = [
    "MoEOverlapHandlers", "announce_overlap", "asking_for_plans", "describe_layers", "layers_to_announce", "overlap_enabled",
]
