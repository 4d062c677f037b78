"""``--dualpipe-layout auto``: the layers-per-stage split with the shortest simulated step for
the parsed Megatron arguments (FLOP count of the configured GPT; see
:mod:`dualpipe_megatron.schedules.layout`), and :func:`model_shape`, the one translation of
Megatron's arguments into the layer model (:mod:`dualpipe_megatron.schedules.model_shape`),
which the launch plan's projection uses too.

Works on the arguments before and after Megatron's ``validate_args``: sizes that validation
fills in (FFN width, per-head width, query groups, data-parallel size) fall back to Megatron's
defaults here. The tokenizer is built after the layout must be fixed, so the vocabulary comes
from ``--vocab-size`` (or an already known padded size).
"""

from __future__ import annotations

import argparse

from ..schedules.ir import ScheduleError
from ..schedules.layout import LayerCosts, best_layout
from ..schedules.model_shape import ModelShape


def _ffn(args: argparse.Namespace) -> int:
    if args.ffn_hidden_size:
        return args.ffn_hidden_size
    if getattr(args, "swiglu", False):  # Megatron's default for SwiGLU: 2/3 of 4h, a multiple of 64
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64
    return 4 * args.hidden_size


def microbatches(args: argparse.Namespace) -> int:
    """Micro-batches per step: global / (micro x data parallel); 2P (the least our schedules
    run) when the global batch is not given."""
    pp = args.pipeline_model_parallel_size
    if args.global_batch_size is None or args.micro_batch_size is None:
        return 2 * pp
    dp = getattr(args, "data_parallel_size", None) or getattr(args, "world_size", 1) // (
        args.tensor_model_parallel_size * pp * (getattr(args, "context_parallel_size", 1) or 1))
    return max(1, args.global_batch_size // (args.micro_batch_size * max(dp, 1)))


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The model these arguments configure, with one expert-parallel rank's share of experts."""
    vocab = getattr(args, "padded_vocab_size", None) or args.vocab_size
    if not vocab:
        raise ScheduleError("the FLOP count (--dualpipe-layout auto, the launch plan) needs --vocab-size (the "
                            "output layer's cost; the tokenizer is built after the layout is fixed), or pass a layout")
    if not args.seq_length:
        raise ScheduleError("the FLOP count (--dualpipe-layout auto, the launch plan) needs --seq-length")
    ffn = _ffn(args)
    experts = args.num_experts or 0
    return ModelShape(
        num_layers=args.num_layers, hidden=args.hidden_size, seq=args.seq_length, vocab=vocab, ffn=ffn,
        heads=args.num_attention_heads, kv_channels=args.kv_channels,
        query_groups=args.num_query_groups if args.group_query_attention else None,
        gated=bool(args.swiglu), micro_batch=args.micro_batch_size or 1, experts=experts,
        topk=args.moe_router_topk if experts else 1, moe_ffn=args.moe_ffn_hidden_size or ffn,
        shared_ffn=args.moe_shared_expert_intermediate_size or 0,
        moe_layer_freq=(args.moe_layer_freq if isinstance(args.moe_layer_freq, int)
                        else tuple(args.moe_layer_freq)),
        mtp_layers=args.mtp_num_layers or 0, mla=bool(args.multi_latent_attention),
        q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
        qk_pos_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
        ep=getattr(args, "expert_model_parallel_size", None) or 1)


def auto_layout(args: argparse.Namespace) -> str:
    """The ``--dualpipe-layout`` string for ``args.pipeline_schedule`` (dualpipe or dualpipev)."""
    return best_layout(args.pipeline_schedule, args.pipeline_model_parallel_size, microbatches(args),
                       LayerCosts.from_shape(model_shape(args)))[0]


__all__ = ["auto_layout", "microbatches", "model_shape"]
