"""Megatron's MoE layers as EPLB sees them: a router to count and remap, expert slots to move.

Megatron places expert ``i`` of EP rank ``r`` at global index ``r * k + i`` and routes in that
index space. We keep the router logical (group-limited routing, expert bias and aux losses
all index logical experts) and permute its output columns into physical slot order, so the
dispatcher sends each token to the slot that now holds its expert: the model computes the
same function whatever the placement. With redundant experts the columns become compute
slots instead, one copy per routed token (:func:`.redundancy.route_to_copies`). The same hook
counts tokens per logical expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .redundancy import route_to_copies

# (kind, number): kind "decoder" or "mtp"; number is the layer's own 1-based layer_number.
LayerKey = tuple[str, int]


@dataclass
class MoELayerHandle:
    """One MoE layer of one model chunk (under dualpipe a layer may live on two ranks)."""

    key: LayerKey
    router: torch.nn.Module
    experts: torch.nn.Module
    num_experts: int
    ep_group: Any
    slot_params: list[list[torch.nn.Parameter]]
    phy2log: torch.Tensor | None = None  # None: Megatron's identity placement
    counts: torch.Tensor | None = None  # this rank's tokens per logical expert since the last read
    hook: Any = field(default=None, repr=False)
    moe: torch.nn.Module | None = field(default=None, repr=False)  # the MoELayer itself
    copies: Any = None  # redundancy.CopyTable with redundant experts (then phy2log places parameters only)
    slot_counts: torch.Tensor | None = None  # with redundant experts: this rank's tokens per compute slot

    @property
    def ep_size(self) -> int:
        return dist.get_world_size(self.ep_group)

    @property
    def ep_rank(self) -> int:
        return dist.get_rank(self.ep_group)


_TE_SLOT = re.compile(r"^(.*\D)(\d+)$")


def expert_slots(experts: torch.nn.Module, num_local: int) -> list[list[torch.nn.Parameter]]:
    """Each local expert's parameters, in a fixed order: SequentialMLP's ``local_experts[i]``,
    or TEGroupedMLP's ``weight{i}``/``bias{i}``."""
    local = getattr(experts, "local_experts", None)
    if local is not None:
        return [list(expert.parameters()) for expert in local]
    slots: list[list[torch.nn.Parameter]] = [[] for _ in range(num_local)]
    for name, param in experts.named_parameters():
        match = _TE_SLOT.match(name)
        if match is None or int(match.group(2)) >= num_local:
            raise NotImplementedError(
                f"EPLB cannot tell which local expert {type(experts).__name__}.{name} belongs to; "
                f"supported: SequentialMLP and TEGroupedMLP with one weight per expert")
        slots[int(match.group(2))].append(param)
    return slots


_MTP_DEPTH = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")


def _layer_key(name: str, module: Any) -> LayerKey:
    """A decoder MoE layer by its global layer number; an MTP one by its depth (1-based), which
    a GPT MTP layer's number is too, while a HybridModel MTP depth numbers its inner layers anew."""
    depth = _MTP_DEPTH.search(name)
    return ("decoder", int(module.layer_number)) if depth is None else ("mtp", int(depth.group(1)) + 1)


def find_moe_layers(model_chunks: list[torch.nn.Module]) -> list[MoELayerHandle]:
    """Every MoE layer (decoder and MTP) of this rank's chunks, in chunk and module order."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    found = []
    for chunk in model_chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, MoELayer):
                continue
            num_local = module.num_local_experts
            found.append(MoELayerHandle(
                key=_layer_key(name, module), router=module.router, experts=module.experts,
                num_experts=module.config.num_moe_experts, ep_group=module.ep_group,
                slot_params=expert_slots(module.experts, num_local), moe=module))
    keys = [h.key for h in found]
    if len(set(keys)) != len(keys):
        raise ValueError("EPLB supports one MoE layer per MTP depth (this model's MTP pattern has more)")
    return found


def install_router_hook(layer: MoELayerHandle) -> None:
    """Count logical routing (in training mode: not evaluation) and hand the dispatcher
    physical columns."""

    def hook(module: torch.nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> Any:
        probs, routing_map = output
        if module.training:
            tokens = routing_map.sum(dim=0, dtype=torch.int64)
            layer.counts = tokens if layer.counts is None else layer.counts + tokens
        if layer.copies is not None:
            probs, routing_map = route_to_copies(probs, routing_map, layer.copies, layer.ep_rank)
            if module.training:
                tokens = routing_map.sum(dim=0, dtype=torch.int64)
                layer.slot_counts = tokens if layer.slot_counts is None else layer.slot_counts + tokens
            return probs, routing_map
        if layer.phy2log is None:
            return output
        columns = layer.phy2log.to(probs.device)
        return probs[:, columns], routing_map[:, columns]

    if layer.hook is None:
        layer.hook = layer.router.register_forward_hook(hook)


def take_counts(layer: MoELayerHandle) -> torch.Tensor:
    """Tokens per logical expert routed here since the last call (zeros if none)."""
    counts = layer.counts
    layer.counts = None
    return torch.zeros(layer.num_experts, dtype=torch.int64) if counts is None else counts.cpu()


def take_slot_counts(layer: MoELayerHandle) -> torch.Tensor:
    """With redundant experts: tokens per compute slot routed here since the last call."""
    counts = layer.slot_counts
    layer.slot_counts = None
    return torch.zeros(layer.copies.num_slots, dtype=torch.int64) if counts is None else counts.cpu()


__all__ = ["LayerKey", "MoELayerHandle", "expert_slots", "find_moe_layers", "install_router_hook",
           "take_counts", "take_slot_counts"]
