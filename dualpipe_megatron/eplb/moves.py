"""Re-place one MoE layer's experts: weights and optimizer state travel between EP ranks.

Every slot whose logical expert changes receives that expert's whole content from the slot
holding it now: the model weights, the optimizer's fp32 main copy and its moments, packed
into one fp32 vector per slot (bf16/fp16 widen exactly) and exchanged with one all-to-all
over the layer's EP group. Copies are exact, so the moved model computes what it did.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .experts import MoELayerHandle
from .optimizer_state import OptimizerTensors
from .placement import sources


def _pack(params: list[torch.nn.Parameter], states: OptimizerTensors) -> torch.Tensor:
    parts = []
    for param in params:
        parts.append(param.detach().float().flatten())
        tensors = states.read(param)
        parts.extend(tensors[key] for key in states.read_keys(param))
    return torch.cat(parts)


def _unpack(vector: torch.Tensor, params: list[torch.nn.Parameter], states: OptimizerTensors) -> None:
    offset = 0
    for param in params:
        n = param.numel()
        param.data.copy_(vector[offset:offset + n].view_as(param))
        offset += n
        tensors = {}
        for key in states.read_keys(param):
            tensors[key] = vector[offset:offset + n]
            offset += n
        states.write(param, tensors)
    if offset != vector.numel():
        raise RuntimeError(f"EPLB: received {vector.numel()} values for a slot of {offset}")


def current_placement(layer: MoELayerHandle) -> torch.Tensor:
    return torch.arange(layer.num_experts) if layer.phy2log is None else layer.phy2log


def move_experts(layer: MoELayerHandle, new: torch.Tensor, states: OptimizerTensors) -> int:
    """Make ``layer`` hold placement ``new`` (``phy2log``); returns how many slots changed expert.

    Collective over the layer's EP group (and, under the distributed optimizer, its expert
    data-parallel group); every rank passes the same ``new``.
    """
    current = current_placement(layer)
    src = sources(current, new).tolist()
    ep_size, me = layer.ep_size, layer.ep_rank
    per_rank = layer.num_experts // ep_size
    moved = [d for d in range(layer.num_experts) if src[d] != d]
    if moved:
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(ep_size)]
        incoming: list[list[int]] = [[] for _ in range(ep_size)]
        packed: dict[int, torch.Tensor] = {}
        for d in moved:
            s = src[d]
            if s // per_rank == me:
                if s not in packed:
                    packed[s] = _pack(layer.slot_params[s % per_rank], states)
                outgoing[d // per_rank].append(packed[s])
            if d // per_rank == me:
                incoming[s // per_rank].append(d % per_rank)
        width = len(next(iter(packed.values()))) if packed else _slot_width(layer, states)
        device = layer.slot_params[0][0].device
        send = torch.cat([v for vs in outgoing for v in vs]) if any(outgoing) else torch.empty(0, device=device)
        recv = torch.empty(sum(map(len, incoming)) * width, dtype=torch.float32, device=device)
        dist.all_to_all_single(recv, send, [len(v) * width for v in incoming],
                               [len(v) * width for v in outgoing], group=layer.ep_group)
        slots = [i for vs in incoming for i in vs]
        for i, vector in zip(slots, recv.split(width)):
            _unpack(vector, layer.slot_params[i], states)
    layer.phy2log = None if torch.equal(new, torch.arange(layer.num_experts)) else new.clone()
    return len(moved)


def _slot_width(layer: MoELayerHandle, states: OptimizerTensors) -> int:
    """Values per packed slot on a rank that sends nothing (its slots look like everyone's)."""
    return sum(p.numel() * (1 + len(states.read_keys(p))) for p in layer.slot_params[0])


__all__ = ["current_placement", "move_experts"]
