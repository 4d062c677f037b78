"""A DeepSeek-V3-shaped MoE layer in plain torch, as one expert-parallel rank computes it.

Plain torch rather than Megatron so the same code runs single-process on a CPU,
on a bare GPU machine, and on the meta device (where FLOPs and saved bytes of
the full-size layer are counted without memory). Every linear is a
:class:`DeferrableLinear`, so a backward can leave its weight grads to a ``W``.

What stands in for what:
- attention is MLA (compressed queries and keys/values, a rotary key part shared
  by all heads); the rotary rotation itself is left out (elementwise, no FLOPs
  to speak of).
- the all-to-all is a local permutation: each token's ``topk`` copies are
  grouped by expert and split *evenly* over the rank's ``experts // ep`` local
  experts, which is the load a balanced EP rank receives. Its communication time
  is modelled separately (:mod:`.comm`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as TF
from torch import nn

from ..runtime.wgrad import DeferrableLinear
from ..schedules.model_shape import ModelShape


class AttentionCore(nn.Module):
    """Causal softmax attention over (batch, heads, tokens, dim) tensors."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return TF.scaled_dot_product_attention(q, k, v, is_causal=True)


class LatentAttention(nn.Module):
    """Multi-head latent attention with DeepSeek-V3's projections."""

    def __init__(self, s: ModelShape, linear: partial) -> None:
        super().__init__()
        self.s = s
        self.q_down = linear(s.hidden, s.q_lora_rank)
        self.q_norm = nn.RMSNorm(s.q_lora_rank)
        self.q_up = linear(s.q_lora_rank, s.heads * (s.qk_head_dim + s.qk_pos_dim))
        self.kv_down = linear(s.hidden, s.kv_lora_rank + s.qk_pos_dim)
        self.kv_norm = nn.RMSNorm(s.kv_lora_rank)
        self.kv_up = linear(s.kv_lora_rank, s.heads * (s.qk_head_dim + s.v_head_dim))
        self.out = linear(s.heads * s.v_head_dim, s.hidden)
        self.core = AttentionCore()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        q = self.q_up(self.q_norm(self.q_down(x))).view(b, t, s.heads, -1)
        latent, k_rope = self.kv_down(x).split([s.kv_lora_rank, s.qk_pos_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).view(b, t, s.heads, -1)
        k_nope, v = kv.split([s.qk_head_dim, s.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(b, t, s.heads, s.qk_pos_dim)], dim=-1)
        o = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(o.transpose(1, 2).reshape(b, t, s.heads * s.v_head_dim))


class SwiGLU(nn.Module):
    """One expert (or the shared experts fused): gated up-projection, then down."""

    def __init__(self, hidden: int, ffn: int, linear: partial) -> None:
        super().__init__()
        self.up = linear(hidden, 2 * ffn)
        self.down = linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(TF.silu(gate) * up)


class BalancedMoE(nn.Module):
    """Sigmoid top-k routing, the rank's local experts under balanced load, a shared expert."""

    def __init__(self, s: ModelShape, linear: partial) -> None:
        super().__init__()
        self.s = s
        self.router = linear(s.hidden, s.experts)
        self.experts = nn.ModuleList(
            SwiGLU(s.hidden, s.expert_ffn, linear) for _ in range(s.local_experts))
        self.shared = SwiGLU(s.hidden, s.shared_ffn, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, tokens = self.s, x.reshape(-1, x.shape[-1])
        scores, chosen = torch.sigmoid(self.router(tokens)).topk(s.topk, dim=-1)
        gates = (scores / scores.sum(dim=-1, keepdim=True)).to(x.dtype)
        # Dispatch stand-in: copies sorted by local expert, cut into equal loads.
        order = torch.argsort(chosen.remainder(s.local_experts).flatten(), stable=True)
        copies = tokens[order // s.topk]
        outs = torch.cat([e(c) for e, c in zip(self.experts, copies.chunk(s.local_experts))])
        # Combine stand-in: back to token order, weighted by the gates.
        routed = outs[torch.argsort(order)].view(-1, s.topk, x.shape[-1])
        mixed = (routed * gates.unsqueeze(-1)).sum(dim=1)
        return (mixed + self.shared(tokens)).view_as(x)


class MoELayer(nn.Module):
    """Pre-norm transformer layer: MLA then MoE, each with a residual."""

    def __init__(self, s: ModelShape, linear: partial) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(s.hidden)
        self.attn = LatentAttention(s, linear)
        self.moe_norm = nn.RMSNorm(s.hidden)
        self.moe = BalancedMoE(s, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


def build_chunk(s: ModelShape, device: torch.device | str, dtype: torch.dtype) -> nn.Sequential:
    """``s.num_layers`` MoE layers on ``device`` (``"meta"`` allocates nothing)."""
    linear = partial(DeferrableLinear, bias=False, device=device, dtype=dtype)
    with torch.device(device):
        chunk = nn.Sequential(*(MoELayer(s, linear) for _ in range(s.num_layers)))
    return chunk.to(dtype=dtype)


def chunk_input(s: ModelShape, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """One micro-batch of hidden states entering the chunk, as received from the previous stage."""
    return torch.randn(s.micro_batch, s.seq, s.hidden, device=device, dtype=dtype, requires_grad=True)


__all__ = ["AttentionCore", "BalancedMoE", "MoELayer", "build_chunk", "chunk_input"]
