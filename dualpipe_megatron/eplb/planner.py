"""Expert-parallel load balancer: replicate hot experts and place replicas on GPUs.

Same algorithm, argument meaning, outputs and tie-breaking as DeepSeek's EPLB
(github.com/deepseek-ai/EPLB): greedy balanced packing (heaviest item first into
the lightest pack that still has room, lowest pack index on ties) and replication of
the expert with the largest load per replica. The hierarchical policy packs
expert groups onto nodes first, then replicates and packs within each node; the
global policy is the hierarchical one with a single group on a single node.
Loads are planned in float32 on the CPU, like the reference, so that equal
inputs give bit-identical placements.
"""

from __future__ import annotations

import struct

import torch

Plan = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _f32(value: float) -> float:
    """Round to float32: keeps the greedy's running sums (and so its ties) as the reference's."""
    return struct.unpack("f", struct.pack("f", value))[0]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack the ``n`` items of each row into ``num_packs`` packs of ``n / num_packs`` items.

    Returns ``(pack, slot)``, both ``[rows, n]``: the pack of every item and its
    position inside the pack (the order in which the greedy filled it).
    """
    rows, items = weight.shape
    per_pack = items // num_packs
    if per_pack == 1:
        identity = torch.arange(items, dtype=torch.int64).expand(rows, items).clone()
        return identity, torch.zeros_like(identity)
    # Equal weights are ordered as torch's default (unstable) CPU sort orders them, like
    # the reference: a stable sort differs on rows longer than 16 and so changes the plan.
    order = torch.sort(weight, dim=-1, descending=True).indices.tolist()
    values = weight.tolist()
    pack = torch.empty((rows, items), dtype=torch.int64)
    slot = torch.empty((rows, items), dtype=torch.int64)
    for row in range(rows):
        loads = [0.0] * num_packs
        counts = [0] * num_packs
        for item in order[row]:
            target = min((p for p in range(num_packs) if counts[p] < per_pack), key=loads.__getitem__)
            pack[row, item] = target
            slot[row, item] = counts[target]
            loads[target] = _f32(loads[target] + values[row][item])
            counts[target] += 1
    return pack, slot


def replicate_experts(weight: torch.Tensor, num_phy: int) -> Plan:
    """Give each of the ``num_log`` experts of a row one replica, then hand the
    ``num_phy - num_log`` extra replicas out one by one to the expert with the
    largest load per replica (lowest index on ties).

    Returns ``(phy2log, rank, count)``: the expert of each replica ``[rows, num_phy]``,
    the replica's rank among its expert's replicas, and replicas per expert ``[rows, num_log]``.
    """
    rows, num_log = weight.shape
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros((rows, num_phy), dtype=torch.int64)
    count = torch.ones((rows, num_log), dtype=torch.int64)
    every_row = torch.arange(rows)
    for replica in range(num_log, num_phy):
        hottest = (weight / count).argmax(dim=-1)
        phy2log[:, replica] = hottest
        rank[:, replica] = count[every_row, hottest]
        count[every_row, hottest] += 1
    return phy2log, rank, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Inverse of each row's permutation."""
    inverse = torch.empty_like(perm)
    positions = torch.arange(perm.size(1), dtype=torch.int64).expand_as(perm)
    return inverse.scatter_(1, perm, positions)


def _hierarchical(weight: torch.Tensor, num_replicas: int, num_groups: int,
                  num_nodes: int, num_gpus: int) -> Plan:
    """Groups onto nodes, replicas within each node, replicas onto the node's GPUs.

    Returns ``(phy2log, replica rank, logcnt)``.
    """
    layers, num_log = weight.shape
    group_size = num_log // num_groups
    log_per_node = num_log // num_nodes
    phy_per_node = num_replicas // num_nodes
    slots_per_gpu = num_replicas // num_gpus

    # Step 1: whole groups onto nodes; number the experts node by node ("node-major").
    group_load = weight.view(layers, num_groups, group_size).sum(dim=-1)
    node, node_slot = balanced_packing(group_load, num_nodes)
    group_start = (node * (num_groups // num_nodes) + node_slot) * group_size
    node_major = (group_start.unsqueeze(-1) + torch.arange(group_size)).reshape(layers, num_log)
    expert_at = _inverse(node_major)  # node-major position -> logical expert

    # Step 2: replicate inside each node (one row per (layer, node)).
    local_load = weight.gather(1, expert_at).reshape(layers * num_nodes, log_per_node)
    replica_local, replica_rank, local_count = replicate_experts(local_load, phy_per_node)

    # Step 3: the node's replicas onto its GPUs.
    replica_load = (local_load / local_count).gather(1, replica_local)
    gpu, gpu_slot = balanced_packing(replica_load, num_gpus // num_nodes)
    replica_at = _inverse(gpu * slots_per_gpu + gpu_slot)  # physical slot -> replica

    local_at = replica_local.gather(1, replica_at).view(layers, num_nodes, phy_per_node)
    node_offset = (torch.arange(num_nodes) * log_per_node).view(1, -1, 1)
    phy2log = expert_at.gather(1, (local_at + node_offset).reshape(layers, num_replicas))
    rank = replica_rank.gather(1, replica_at).reshape(layers, num_replicas)
    logcnt = local_count.reshape(layers, num_log).gather(1, node_major)
    return phy2log, rank, logcnt


def _check(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """Reject inputs the algorithm cannot plan, with the reason."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, num_logical_experts], got shape {tuple(weight.shape)}")
    layers, num_log = weight.shape
    if layers == 0 or num_log == 0:
        raise ValueError(f"weight must not be empty, got shape {tuple(weight.shape)}")
    for name, value in (("num_replicas", num_replicas), ("num_groups", num_groups),
                        ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if weight.is_complex() or not bool(torch.isfinite(weight).all()) or bool((weight < 0).any()):
        raise ValueError("weight must hold finite, non-negative loads")
    if num_replicas < num_log:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= the number of logical experts ({num_log})")
    if num_log % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide the number of logical experts ({num_log})")
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide num_gpus ({num_gpus})")
    if num_replicas % num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must divide num_replicas ({num_replicas})")


def hierarchical_problem(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int,
                         num_gpus: int) -> str | None:
    """Why :func:`rebalance_experts` would not keep groups on nodes for these sizes (None: it does):
    an input it refuses, or nodes that do not divide the groups (its global policy)."""
    try:
        _check(torch.zeros(1, num_experts), num_replicas, num_groups, num_nodes, num_gpus)
    except ValueError as exc:
        return str(exc)
    if num_groups % num_nodes:
        return f"{num_nodes} nodes do not divide {num_groups} expert groups"
    return None


def _log2phy(phy2log: torch.Tensor, rank: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """``[layers, num_log, max replicas]``: replica ids of each expert by rank, padded with -1."""
    layers, num_log = logcnt.shape
    width = int(logcnt.max())
    table = torch.full((layers, num_log * width), -1, dtype=torch.int64)
    replicas = torch.arange(phy2log.size(1), dtype=torch.int64).expand_as(phy2log)
    table.scatter_(1, phy2log * width + rank, replicas)
    return table.view(layers, num_log, width)


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int,
                      num_nodes: int, num_gpus: int) -> Plan:
    """Plan ``num_replicas`` physical experts per layer over ``num_gpus`` GPUs on ``num_nodes`` nodes.

    ``weight`` is the ``[layers, num_logical_experts]`` load; experts form
    ``num_groups`` equal contiguous groups. The hierarchical policy (groups kept
    within a node) is used when ``num_nodes`` divides ``num_groups``, else the
    global one. Returns ``(phy2log [layers, num_replicas], log2phy [layers,
    num_logical, max replicas] padded with -1, logcnt [layers, num_logical])``;
    GPU ``g`` holds physical slots ``g*k .. (g+1)*k-1``, ``k = num_replicas / num_gpus``.
    """
    _check(weight, num_replicas, num_groups, num_nodes, num_gpus)
    load = weight.detach().float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(load, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(load, num_replicas, 1, 1, num_gpus)
    return phy2log, _log2phy(phy2log, rank, logcnt), logcnt
