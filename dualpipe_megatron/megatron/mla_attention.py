"""Core attention for multi-latent attention (MLA) in Megatron's local spec.

MLA's queries and keys are ``qk_head_dim + qk_pos_emb_head_dim`` wide (the part without position
and the decoupled rotary part) and its values ``v_head_dim``; ``MultiLatentAttention`` builds its
core attention with ``k_channels``, ``v_channels`` and its own softmax scale (with YaRN's mscale).
Megatron 0.19's local ``DotProductAttention`` takes neither head size, so MLA in the local spec
does not build (Transformer Engine's attention takes them, hence GPUs never see this). Without TE
(on CPU) this module stands in for it, for MLA only: the CPU compatibility layer swaps it in
(``cpu_compat``'s ``mla`` group) where MLA's submodules name Megatron's local attention.

The math is Megatron's local attention's, per head: ``softmax(scale * q k^T + causal mask) v``
with Megatron's masked softmax (``FusedScaleMaskSoftmax``: fp32 softmax for fp16/bf16 scores,
query-key layer scaling, its -10000 mask fill), dropout on the probabilities inside the
tensor-parallel RNG tracker, and the heads of this tensor-parallel rank only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import attention_mask_func
from megatron.core.utils import divide


def _refuse_unsupported(config: TransformerConfig) -> None:
    """What Megatron's local attention lacks too, or MLA's TE attention alone provides."""
    refused = {
        "context parallelism (--context-parallel-size > 1)": config.context_parallel_size > 1,
        f"--softmax-type {config.softmax_type}": config.softmax_type != "vanilla",
        "sliding-window attention (--window-size)": config.window_size is not None,
        "QK-clip / max attention-logit logging": config.qk_clip or config.log_max_attention_logit,
    }
    named = [what for what, asked in refused.items() if asked]
    if named:
        raise ValueError(f"MLA with Megatron's local spec (--transformer-impl local) does not support "
                         f"{', '.join(named)}; use Transformer Engine's spec for it")


class MLADotProductAttention(MegatronModule):
    """Scaled dot-product attention with separate query-key and value head sizes."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, k_channels: int | None = None,
                 v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None) -> None:
        super().__init__(config=config)
        _refuse_unsupported(config)
        self.attn_mask_type = attn_mask_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.heads_per_partition = divide(config.num_attention_heads, pg_collection.tp.size())
        scale = 1.0 / math.sqrt(self.k_channels) if softmax_scale is None else softmax_scale
        # Query-key layer scaling divides the scores by the layer number and the softmax
        # multiplies them back in fp32 (an fp16 overflow guard), as Megatron's attention does.
        coeff = max(1, layer_number) if config.apply_query_key_layer_scaling else None
        self.softmax_scale = scale / coeff if coeff else scale
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=config.fp16, input_in_bf16=config.bf16, attn_mask_type=attn_mask_type,
            scaled_masked_softmax_fusion=config.masked_softmax_fusion,
            mask_func=attention_mask_func, softmax_in_fp32=config.attention_softmax_in_fp32,
            scale=coeff)
        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        """``query``/``key`` [s, b, heads, k_channels], ``value`` [s, b, heads, v_channels] ->
        [s, b, heads * v_channels]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("MLA with the local spec takes neither packed sequences nor an attention bias")
        if attn_mask_type not in (None, self.attn_mask_type):
            raise ValueError(f"MLA's local attention was built for {self.attn_mask_type}, "
                             f"called with {attn_mask_type}")
        sq, batch, heads, _ = query.shape
        expected = (heads, self.k_channels), (heads, self.k_channels), (heads, self.v_channels)
        found = tuple(tuple(t.shape[2:]) for t in (query, key, value))
        if heads != self.heads_per_partition or found != expected:
            raise ValueError(f"MLA's local attention expects {self.heads_per_partition} heads of "
                             f"q/k {self.k_channels}, v {self.v_channels}; got q/k/v {found}")
        # [s, b, n, d] -> [b, n, s, d]: one matrix product per (batch, head).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        probs = self.scale_mask_softmax(scores, attention_mask)
        if self.training and self.attention_dropout.p > 0:
            if self.config.sequence_parallel:  # Megatron draws these outside the tracker under SP
                probs = self.attention_dropout(probs)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
        context = torch.matmul(probs, v)  # [b, n, sq, v_channels]
        return context.permute(2, 0, 1, 3).reshape(sq, batch, heads * self.v_channels)


def _is_local_attention(core_attention: Any) -> bool:
    module = core_attention.module if isinstance(core_attention, ModuleSpec) else core_attention
    return module is DotProductAttention


def with_mla_core_attention(submodules: Any) -> Any:
    """MLA's submodules with Megatron's local attention, which cannot build under MLA, replaced
    by :class:`MLADotProductAttention`; any other core attention (TE's, a user's) is kept."""
    attention = submodules.core_attention
    if not _is_local_attention(attention):
        return submodules
    replacement = (dataclasses.replace(attention, module=MLADotProductAttention)
                   if isinstance(attention, ModuleSpec) else MLADotProductAttention)
    return dataclasses.replace(submodules, core_attention=replacement)


__all__ = ["MLADotProductAttention", "with_mla_core_attention"]
