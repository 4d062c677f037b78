"""Redundant experts in one Megatron MoE layer: more compute slots than parameters.

:class:`LayerReplicas` turns a layer with ``E/EP`` local experts into one computing ``S/EP``
slots (:mod:`.redundancy`): the token dispatcher is rebuilt for ``S`` slots (Megatron's own
class, so alltoall and allgather both work), and the ``SequentialMLP``'s forward runs each
local slot through either the owned expert module or a *replica*: that module's function
(``torch.func.functional_call``) applied to plain tensors outside the model. Replicas are not
parameters, so Megatron's optimizer, DDP buffers, grad norm and checkpoints never see them.

Their gradients collect in an fp32 ``main_grad`` of their own, as DDP does for parameters
(also when the weight-grad split or gradient-accumulation fusion writes there directly);
:meth:`reduce_grads` adds them into the owner's gradient before Megatron's data-parallel
reduction, and :meth:`sync_weights` copies the owners' updated weights back after each step.
Both are one ``all_to_all_single`` over the EP group.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch.func import functional_call

from ..megatron.grads import grad_of
from .experts import MoELayerHandle
from .moves import current_placement
from .redundancy import copy_table, replica_transfers


def supported(experts: torch.nn.Module) -> str | None:
    """Why redundant experts cannot run in this experts module (None: they can)."""
    if getattr(experts, "local_experts", None) is None:
        return (f"redundant experts need Megatron's SequentialMLP experts (not {type(experts).__name__}; "
                f"leave out --moe-grouped-gemm)")
    config = experts.config
    if config.fp8 or getattr(config, "fp4", None):
        return "redundant experts do not support FP8/FP4 experts"
    if config.moe_apply_probs_on_input:
        return "redundant experts do not support --moe-apply-probs-on-input"
    return None


def _rebuilt_dispatcher(moe: torch.nn.Module, num_slots: int) -> Any:
    """Megatron's dispatcher of the same class, for ``num_slots`` experts over the EP group."""
    old = moe.token_dispatcher
    config = copy.copy(old.config)
    config.num_moe_experts = num_slots
    per_rank = num_slots // old.ep_size
    groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
    new = type(old)(per_rank, list(range(old.ep_rank * per_rank, (old.ep_rank + 1) * per_rank)),
                    config=config, pg_collection=groups)
    if old.shared_experts is not None:
        new.set_shared_experts(old.shared_experts)
    return new


def _accumulate_into_main_grad(tensor: torch.Tensor) -> None:
    """DDP's grad hook for a replica: fold ``.grad`` into ``main_grad`` (unless already there)."""
    if getattr(tensor, "grad_added_to_main_grad", False):
        tensor.grad_added_to_main_grad = False
    elif tensor.grad is not None:
        tensor.main_grad.add_(tensor.grad)
    tensor.grad = None


class LayerReplicas:
    """One MoE layer's compute slots on this rank, the replicas among them, and their syncs."""

    def __init__(self, layer: MoELayerHandle, num_slots: int) -> None:
        problem = supported(layer.experts)
        if problem:
            raise NotImplementedError(problem)
        self.layer = layer
        self.num_slots = num_slots
        self.template = layer.experts.local_experts[0]
        self.names = [name for name, _ in self.template.named_parameters()]
        self.buffers: dict[int, list[torch.Tensor]] = {}  # expert -> replica tensors (template order)
        self.compute: list[tuple[int | None, int]] = []  # per local slot: (owned module index or None, expert)
        self.transfers: list[tuple[int, int, int]] = []
        self.replica_tokens = 0  # token copies computed by replicas since the last read
        layer.moe.token_dispatcher = _rebuilt_dispatcher(layer.moe, num_slots)
        layer.experts.forward = self._forward

    # -- placement ---------------------------------------------------------------------------
    def place(self, slots: torch.Tensor, owners: torch.Tensor) -> None:
        """Compute ``slots`` with parameters placed as ``owners``; replicas made and filled."""
        ep_size, me = self.layer.ep_size, self.layer.ep_rank
        per_rank, per_rank_slots = owners.numel() // ep_size, slots.numel() // ep_size
        mine = owners[me * per_rank:(me + 1) * per_rank].tolist()
        local = slots[me * per_rank_slots:(me + 1) * per_rank_slots].tolist()
        self.compute = [(mine.index(e) if e in mine else None, e) for e in local]
        self.transfers = replica_transfers(slots, owners, ep_size)
        wanted = {e for e, _, r in self.transfers if r == me}
        self.buffers = {e: self.buffers.get(e) or self._new_replica() for e in sorted(wanted)}
        self.layer.copies = copy_table(slots, self.layer.num_experts)
        self.sync_weights()

    def _new_replica(self) -> list[torch.Tensor]:
        tensors = []
        for param in self.template.parameters():
            replica = torch.empty_like(param, requires_grad=True)
            owner_grad = grad_of(param)
            replica.main_grad = torch.zeros_like(param, dtype=owner_grad.dtype if owner_grad is not None
                                                 else torch.float32)
            replica.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            tensors.append(replica)
        return tensors

    @property
    def extra_bytes(self) -> int:
        """Replica weights and their gradient buffers on this rank."""
        return sum(t.numel() * t.element_size() + t.main_grad.numel() * t.main_grad.element_size()
                   for tensors in self.buffers.values() for t in tensors)

    # -- forward -----------------------------------------------------------------------------
    def _forward(self, hidden: torch.Tensor, tokens_per_slot: torch.Tensor, probs: torch.Tensor,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``SequentialMLP.forward`` over this rank's compute slots (owned module or replica)."""
        if kwargs:
            raise NotImplementedError(f"redundant experts: unsupported expert arguments {sorted(kwargs)}")
        counts = tokens_per_slot.tolist()
        outputs = []
        for (owned, e), x, p in zip(self.compute, hidden.split(counts), probs.split(counts)):
            if owned is not None:
                out, _ = self.layer.experts.local_experts[owned](x, p)
            else:
                out, _ = functional_call(self.template, dict(zip(self.names, self.buffers[e])), (x, p))
                self.replica_tokens += x.size(0)
            outputs.append(out)
        return torch.cat(outputs), None

    # -- syncs -------------------------------------------------------------------------------
    def _owned(self, e: int) -> list[torch.nn.Parameter]:
        """The parameters of expert ``e``, owned by this rank."""
        per_rank = self.layer.num_experts // self.layer.ep_size
        start = self.layer.ep_rank * per_rank
        return self.layer.slot_params[current_placement(self.layer)[start:start + per_rank].tolist().index(e)]

    def _exchange(self, outgoing: list[list[torch.Tensor]], incoming: list[int], width: int,
                  dtype: torch.dtype) -> list[torch.Tensor]:
        """Send each rank its vectors, receive ``incoming[r]`` vectors of ``width`` from rank ``r``."""
        device = next(self.template.parameters()).device
        send = torch.cat([v for vs in outgoing for v in vs]) if any(outgoing) else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(incoming) * width, dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, [n * width for n in incoming], [len(vs) * width for vs in outgoing],
                               group=self.layer.ep_group)
        return list(recv.split(width)) if width else []

    def _width(self) -> int:
        return sum(p.numel() for p in self.template.parameters())

    def _owner_weights(self) -> list[torch.Tensor]:
        """The owners' weights for every replica this rank holds, in transfer order."""
        me, ep_size = self.layer.ep_rank, self.layer.ep_size
        dtype = next(self.template.parameters()).dtype
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(ep_size)]
        incoming = [0] * ep_size
        for e, owner, replica in self.transfers:
            if owner == me:
                outgoing[replica].append(torch.cat([p.detach().reshape(-1) for p in self._owned(e)]))
            if replica == me:
                incoming[owner] += 1
        return self._exchange(outgoing, incoming, self._width(), dtype)

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Every replica := its owner's weights (bitwise)."""
        received = iter(self._owner_weights())
        for e, _, replica in self.transfers:
            if replica == self.layer.ep_rank:
                vector, offset = next(received), 0
                for tensor in self.buffers[e]:
                    tensor.copy_(vector[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    @torch.no_grad()
    def mismatches(self) -> int:
        """Replica tensors on this rank that differ from their owner's (a consistency check)."""
        received = iter(self._owner_weights())
        bad = 0
        for e, _, replica in self.transfers:
            if replica == self.layer.ep_rank:
                vector, offset = next(received), 0
                for tensor in self.buffers[e]:
                    bad += not torch.equal(tensor, vector[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
        return bad

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Add every replica's gradient into its owner's (then zero it): before DP reduction."""
        me, ep_size = self.layer.ep_rank, self.layer.ep_size
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(ep_size)]
        incoming = [0] * ep_size
        for e, owner, replica in self.transfers:
            if replica == me:
                outgoing[owner].append(torch.cat([t.main_grad.float().reshape(-1) for t in self.buffers[e]]))
                for t in self.buffers[e]:
                    t.main_grad.zero_()
            if owner == me:
                incoming[replica] += 1
        received = iter(self._exchange(outgoing, incoming, self._width(), torch.float32))
        for e, owner, _ in self.transfers:
            if owner != me:
                continue
            vector, offset = next(received), 0
            for param in self._owned(e):
                part = vector[offset:offset + param.numel()].view_as(param)
                offset += param.numel()
                holder = grad_of(param)
                if holder is None:
                    param.grad = part.to(param.dtype).clone()
                else:
                    holder.add_(part.to(holder.dtype))


__all__ = ["LayerReplicas", "supported"]
