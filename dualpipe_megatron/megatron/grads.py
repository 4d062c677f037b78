"""Parameters that exist twice: tied embeddings on one rank, and DualPipe's mirrored stages.

Under DualPipeV (and on DualPipe's end ranks) the embedding and the output
layer sit in two chunks of the *same* rank, so the tie is kept locally: the
output copy starts as the embedding, and their gradients are summed locally
(no cross-rank embedding group, so no collective a peer might never join).

DualPipe holds every stage twice, once per direction: stage ``s`` of
direction 0 on rank ``s`` and of direction 1 on rank ``P-1-s``. The copies
start equal (direction 0 is the source), their gradients are summed across the
mirror pair before any data-parallel reduction, and the direction-1 copy is
marked ``shared`` so grad-norm and zero counting see each parameter once.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core import parallel_state
from megatron.core.utils import get_attr_wrapped_model

from .topology import StageMap


def grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """Where Megatron keeps a parameter's gradient: ``main_grad`` under its DDP, else ``.grad``."""
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def _tied_weights(model: Sequence[nn.Module], stage_map: StageMap, rank: int) -> tuple[nn.Parameter, nn.Parameter] | None:
    """(embedding weight, its copy at the loss stage) when this rank holds both ends of a model
    with such a copy: the tied output layer, or the MTP block's embedding."""
    first = [c for c in range(stage_map.chunks) if stage_map.is_first(rank, c)]
    last = [c for c in range(stage_map.chunks) if stage_map.is_last(rank, c)]
    if not first or not last:
        return None
    pre = model[first[0]]
    # Megatron keeps a second word-embedding copy at the loss stage for a tied output layer, and
    # for the MTP block's embedding (tied or not); _get_shared_word_embedding_weight's rule.
    if not (get_attr_wrapped_model(pre, "share_embeddings_and_output_weights")
            or getattr(get_attr_wrapped_model(pre, "config"), "mtp_num_layers", None)):
        return None
    weight_of = lambda chunk: get_attr_wrapped_model(chunk, "shared_embedding_or_output_weight")()  # noqa: E731
    emb, out = weight_of(pre), weight_of(model[last[0]])
    return (emb, out) if emb is not out else None


@torch.no_grad()
def tie_embeddings_locally(model: Sequence[nn.Module], stage_map: StageMap, rank: int) -> bool:
    """Start the output layer's copy as the embedding (Megatron zero-fills it). True if tied."""
    pair = _tied_weights(model, stage_map, rank)
    if pair is None:
        return False
    pair[1].copy_(pair[0])
    return True


@torch.no_grad()
def sum_tied_embedding_grads(model: Sequence[nn.Module], stage_map: StageMap, rank: int) -> None:
    """Both copies get embedding-grad + output-grad, as one tied weight would."""
    pair = _tied_weights(model, stage_map, rank)
    if pair is None:
        return
    grads = [grad_of(p) for p in pair]
    if any(g is None for g in grads):
        return
    total = grads[0] + grads[1]
    for g in grads:
        g.copy_(total)


def build_mirror_group() -> dist.ProcessGroup | None:
    """Collective: one 2-rank group per DualPipe mirror pair {r, P-1-r} of every pipeline group.

    Returns this rank's group (``None`` when the pipeline has a single rank).
    """
    own = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, own)
    pipelines = sorted({tuple(p) for p in every if p is not None})
    pairs = [[p[r], p[len(p) - 1 - r]] for p in pipelines for r in range(len(p) // 2)]
    if not pairs:
        return None
    mine, _ = dist.new_subgroups_by_enumeration(pairs)
    return mine


def _stage_chunks(stage_map: StageMap, rank: int) -> list[int]:
    """This rank's chunks in model-stage order: the order both members of a pair agree on."""
    return sorted(range(stage_map.chunks), key=lambda c: stage_map.stage(rank, c))


def _params(chunk: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in sorted(chunk.named_parameters(), key=lambda kv: kv[0])]


def _on_comm_device(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor``, or a CUDA copy where ``group`` is NCCL's and it is not on a GPU: the builder
    route prepares chunks before Megatron moves them to the GPU (still on the CPU under
    ``--use-cpu-initialization``), and NCCL moves only CUDA tensors."""
    if not tensor.is_cuda and dist.get_backend(group) == "nccl":
        return tensor.cuda()
    return tensor


@torch.no_grad()
def broadcast_mirrored_params(model: Sequence[nn.Module], stage_map: StageMap, rank: int,
                              group: dist.ProcessGroup) -> None:
    """Make each direction-1 copy equal to its direction-0 copy (chunk 0 holds direction 0)."""
    pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    for c in _stage_chunks(stage_map, rank):
        src_rank = rank if c == 0 else stage_map.ranks - 1 - rank
        params = _params(model[c])
        flat = _on_comm_device(_flatten_dense_tensors([p.data for p in params]), group)
        dist.broadcast(flat, src=pp_ranks[src_rank], group=group)
        for p, synced in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
            p.data.copy_(synced)


def mark_mirror_copies_shared(model: Sequence[nn.Module]) -> None:
    """Direction-1 copies (chunk 1) count as shared: grad norm and zero counting skip them."""
    for p in model[1].parameters():
        p.shared = True


def _sum_in_place(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """All-reduce ``tensors`` over ``group`` as one flat buffer (nothing when empty)."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, summed in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(summed)


@torch.no_grad()
def sum_mirrored_grads(model: Sequence[nn.Module], stage_map: StageMap, rank: int,
                       group: dist.ProcessGroup) -> None:
    """All-reduce each stage's gradients over its two copies, one flat buffer per stage."""
    for c in _stage_chunks(stage_map, rank):
        _sum_in_place([g for g in (grad_of(p) for p in _params(model[c])) if g is not None], group)


@torch.no_grad()
def mirrored_param_mismatch(model: Sequence[nn.Module], stage_map: StageMap, rank: int,
                            group: dist.ProcessGroup) -> float:
    """Largest absolute difference between the two copies of any parameter (debug check)."""
    worst = torch.zeros(())
    for c in _stage_chunks(stage_map, rank):
        params = _params(model[c])
        flat = _flatten_dense_tensors([p.data.float() for p in params])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat, group=group)
        worst = torch.maximum(worst, (both[0] - both[1]).abs().max())
    return float(worst)


def _bias_routers(model: Sequence[nn.Module], stage_map: StageMap, rank: int) -> list[nn.Module]:
    """Routers with aux-loss-free balancing (``--moe-router-enable-expert-bias``), in model-stage
    order, which both members of a mirror pair share."""
    return [m for c in _stage_chunks(stage_map, rank) for m in model[c].modules()
            if getattr(m, "expert_bias", None) is not None
            and getattr(m, "local_tokens_per_expert", None) is not None]


@torch.no_grad()
def sum_mirrored_expert_token_counts(model: Sequence[nn.Module], stage_map: StageMap, rank: int,
                                     group: dist.ProcessGroup) -> None:
    """Sum each router's token counts over its two DualPipe copies.

    Megatron's bias update (``finalize_model_grads``) sums ``local_tokens_per_expert`` over
    TP x CP x DP only, but each copy routed half the micro-batches: without this sum the copies'
    biases drift apart. The counts are whole numbers per logical expert (counted before any EPLB
    permutation), so the sum is exact and both copies then make 1F1B's update.
    """
    _sum_in_place([m.local_tokens_per_expert for m in _bias_routers(model, stage_map, rank)], group)


@torch.no_grad()
def mirrored_expert_bias_mismatches(model: Sequence[nn.Module], stage_map: StageMap, rank: int,
                                    group: dist.ProcessGroup) -> tuple[int, int]:
    """(routers checked, routers whose ``expert_bias`` differs in any bit between the two copies)."""
    biases = [m.expert_bias for m in _bias_routers(model, stage_map, rank)]
    if not biases:
        return 0, 0
    flat = _flatten_dense_tensors(biases)
    both = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(both, flat, group=group)
    differ = sum(not torch.equal(a, b) for a, b in zip(_unflatten_dense_tensors(both[0], biases),
                                                       _unflatten_dense_tensors(both[1], biases)))
    return len(biases), differ
