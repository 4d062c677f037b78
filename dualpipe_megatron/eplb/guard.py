"""Keep the current expert placement unless a new plan is predicted to be clearly better.

The planner is a heuristic: on some loads its plan balances GPUs worse than the
placement already in use, and every change moves expert weights. The guard
predicts each placement's per-GPU load from the per-expert load (an expert's
load splits evenly over its replicas) and adopts the proposal only if it lowers
the imbalance by at least a threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gpu_loads(placement: Sequence[torch.Tensor], load: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Predicted ``[layers, num_gpus]`` load of ``placement = (phy2log, log2phy, logcnt)``.

    GPU ``g`` holds physical slots ``g*k .. (g+1)*k-1``, ``k = num_replicas / num_gpus``.
    """
    phy2log, _, logcnt = placement
    load = load.detach().double().cpu()
    if load.shape != logcnt.shape:
        raise ValueError(f"load shape {tuple(load.shape)} != logcnt shape {tuple(logcnt.shape)}")
    if phy2log.dim() != 2 or phy2log.size(0) != load.size(0):
        raise ValueError(f"phy2log must be [layers={load.size(0)}, num_replicas], got {tuple(phy2log.shape)}")
    if num_gpus < 1 or phy2log.size(1) % num_gpus:
        raise ValueError(f"num_gpus ({num_gpus}) must divide num_replicas ({phy2log.size(1)})")
    per_replica = (load / logcnt).gather(1, phy2log)
    return per_replica.view(load.size(0), num_gpus, -1).sum(dim=-1)


def imbalance(placement: Sequence[torch.Tensor], load: torch.Tensor, num_gpus: int) -> float:
    """Predicted max/mean GPU load, over the whole step: sum over layers of the
    busiest GPU's load / sum over layers of the mean GPU load (1.0 = perfect).

    Each layer waits for its busiest GPU, so this is the predicted step time
    relative to a perfectly balanced placement.
    """
    return overall_imbalance(gpu_loads(placement, load, num_gpus))


def overall_imbalance(per_gpu: torch.Tensor) -> float:
    """:func:`imbalance` of ``[layers, num_gpus]`` loads (predicted or measured)."""
    mean = float(per_gpu.mean(dim=1).sum())
    return float(per_gpu.max(dim=1).values.sum()) / mean if mean > 0 else 1.0


def layer_imbalance(per_gpu: torch.Tensor) -> torch.Tensor:
    """Each layer's busiest GPU over its mean GPU, ``[layers]`` (1 where nothing was routed)."""
    mean = per_gpu.mean(dim=1)
    return torch.where(mean > 0, per_gpu.max(dim=1).values / mean.clamp_min(1e-30), torch.ones_like(mean))


def adopt(current: Sequence[torch.Tensor], proposed: Sequence[torch.Tensor], load: torch.Tensor,
          threshold: float, *, num_gpus: int) -> Sequence[torch.Tensor]:
    """``proposed`` if its predicted imbalance is at least ``threshold`` below ``current``'s, else ``current``."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    gain = imbalance(current, load, num_gpus) - imbalance(proposed, load, num_gpus)
    return proposed if gain >= threshold and gain > 0 else current
