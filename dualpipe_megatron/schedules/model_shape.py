"""The model as every cost model sees it: one GPT / MoE / MLA shape and its FLOP count.

One dataclass (:class:`ModelShape`) serves the layout search (:mod:`.layout`), the projection
(its stages and its plain-torch layer are ModelShapes too), ``--dualpipe-layout auto`` and the
launch plan; Megatron's arguments become one in exactly one place
(:func:`dualpipe_megatron.megatron.auto_layout.model_shape`). Pure Python: no torch.

FLOP convention, one for every user:

- A matrix product of ``t`` tokens by an ``n_in x n_out`` weight is ``2 t n_in n_out`` FLOPs
  (a multiply-add is two). Its backward computes the input grads and the weight grads, each as
  costly as the forward: B = 2F, and W (the deferrable weight-grad part) = F.
- **Causal attention counts the half of the square under the mask**: the scores ``QK^T`` and
  the weighting of ``V`` are ``heads x seq^2 x (qk_dim + v_dim)`` FLOPs per sequence (half of
  the full square's ``2 heads seq^2 (qk_dim + v_dim)``), backward twice that, no W. Causal
  flash kernels skip the blocks above the diagonal, so this is what they compute and what
  their time follows, and it is what Megatron-Core 0.19.2's
  ``megatron.training.training.num_floating_point_operations`` counts (its ``/ 2`` for the
  causal mask). ``torch.utils.flop_counter`` counts the full square even with
  ``is_causal=True``; the tests that compare with it add the other half explicitly.
- Elementwise work (norms, activations, softmax, rotary) counts zero, except the loss: a few
  FLOPs per logit (:data:`LOSS_FLOPS_PER_LOGIT`), and the embedding, a lookup of ``hidden``
  per token.
- MoE: each token visits ``topk`` routed experts; under balanced routing an expert-parallel
  rank computes ``tokens x topk`` expert rows whatever ``ep`` is, so the count is one rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Iterable

from .ir import ScheduleError
from .simulate import Number, StageCost, exact

LOSS_FLOPS_PER_LOGIT = 4  # softmax cross-entropy: a few elementwise FLOPs per logit


def cost_of(F: Number, B: Number, W: Number) -> StageCost:
    """An exact (F, B, W) cost."""
    return StageCost(exact(F), exact(B), exact(W))


def total(costs: Iterable[StageCost]) -> StageCost:
    """The sum of ``costs`` (zero when empty)."""
    out = StageCost(Fraction(0), Fraction(0), Fraction(0))
    for c in costs:
        out = out + c
    return out


@dataclass(frozen=True)
class ModelShape:
    """A GPT model (or a pipeline stage of one); names follow Megatron's arguments.

    ``moe_layer_freq`` is Megatron's: N (layer i is MoE when i % N == 0) or a 0/1 list per
    layer; it applies only with ``experts``. ``q_lora_rank`` None: MLA without query
    compression. ``ep``: expert-parallel ranks, each holding ``experts / ep`` of the experts
    (the projection's layer and all-to-all; the FLOP count does not depend on it).
    """

    num_layers: int
    hidden: int
    seq: int
    vocab: int
    ffn: int | None = None  # None: 4 x hidden
    heads: int = 1
    kv_channels: int | None = None  # None: hidden / heads
    query_groups: int | None = None  # None: heads (no grouped-query attention)
    gated: bool = False  # SwiGLU
    micro_batch: int = 1
    experts: int = 0
    topk: int = 2
    moe_ffn: int | None = None  # None: ffn
    shared_ffn: int = 0
    moe_layer_freq: int | tuple[int, ...] = 1
    mtp_layers: int = 0
    mla: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_dim: int = 64
    v_head_dim: int = 128
    ep: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value, least = getattr(self, f.name), 0 if f.name in ("experts", "shared_ffn", "mtp_layers") else 1
            if type(value) is int and value < least:
                raise ScheduleError(f"model shape: {f.name} must be >= {least}, got {value}")
        if self.experts and self.topk > self.experts:
            raise ScheduleError(f"model shape: top-k ({self.topk}) exceeds the {self.experts} experts")
        if self.experts % self.ep:
            raise ScheduleError(f"model shape: experts ({self.experts}) must divide evenly over ep ({self.ep})")
        if not self.mla and self.kv_channels is None and self.hidden % self.heads:
            raise ScheduleError(f"model shape: hidden size {self.hidden} is not a multiple of {self.heads} heads")
        self.moe_layers()  # the pattern fits the layers

    def moe_layers(self) -> tuple[bool, ...]:
        """Which decoder layers are MoE."""
        n, freq = self.num_layers, self.moe_layer_freq
        if not self.experts:
            return (False,) * n
        if isinstance(freq, int):
            if freq < 1:
                raise ScheduleError(f"model shape: moe_layer_freq must be >= 1, got {freq}")
            return tuple(i % freq == 0 for i in range(n))
        if len(freq) != n or any(v not in (0, 1) for v in freq):
            raise ScheduleError(f"model shape: moe_layer_freq needs one 0/1 per layer ({n}), got {len(freq)} values")
        return tuple(bool(v) for v in freq)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.micro_batch * self.seq

    @property
    def dense_ffn(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.dense_ffn

    @property
    def local_experts(self) -> int:
        """Routed experts on one expert-parallel rank."""
        return self.experts // self.ep

    def _linear(self, n_in: int, n_out: int, tokens: int | None = None) -> StageCost:
        """A weight matmul: B computes the input and the weight grads, each as costly as F."""
        f = 2 * (tokens or self.tokens) * n_in * n_out
        return cost_of(f, 2 * f, f)

    def _core(self, qk_dim: int, v_dim: int) -> StageCost:
        """Causal attention scores and their weighting of values, the half of the square under
        the mask (the module docstring's convention); no weights."""
        f = self.micro_batch * self.heads * self.seq * self.seq * (qk_dim + v_dim)
        return cost_of(f, 2 * f, 0)

    def causal_half(self) -> StageCost:
        """The attention core's other half, above the mask: what a full-square count (torch's
        FLOP counter) adds to one layer of this convention's."""
        if self.mla:
            return self._core(self.qk_head_dim + self.qk_pos_dim, self.v_head_dim)
        d = self.kv_channels or self.hidden // self.heads
        return self._core(d, d)

    def _attention(self) -> StageCost:
        h, a = self.hidden, self.heads
        if self.mla:
            qk = self.qk_head_dim + self.qk_pos_dim
            q = ([self._linear(h, self.q_lora_rank), self._linear(self.q_lora_rank, a * qk)]
                 if self.q_lora_rank else [self._linear(h, a * qk)])
            return total([*q, self._linear(h, self.kv_lora_rank + self.qk_pos_dim),
                          self._linear(self.kv_lora_rank, a * (self.qk_head_dim + self.v_head_dim)),
                          self.causal_half(), self._linear(a * self.v_head_dim, h)])
        d = self.kv_channels or h // a
        g = self.query_groups or a
        return total([self._linear(h, (a + 2 * g) * d), self.causal_half(), self._linear(a * d, h)])

    def _mlp(self, width: int, tokens: int | None = None) -> StageCost:
        up = width * (2 if self.gated else 1)
        return total([self._linear(self.hidden, up, tokens), self._linear(width, self.hidden, tokens)])

    def decoder(self, moe: bool) -> StageCost:
        """One transformer layer: attention, then a dense MLP or the router, the top-k routed
        experts each token visits (balanced over expert-parallel ranks) and the shared experts."""
        if not moe:
            return total([self._attention(), self._mlp(self.dense_ffn)])
        parts = [self._attention(), self._linear(self.hidden, self.experts),
                 self._mlp(self.expert_ffn, self.tokens * self.topk)]
        if self.shared_ffn:
            parts.append(self._mlp(self.shared_ffn))
        return total(parts)

    def embedding(self) -> StageCost:
        """A table lookup, memory-bound: tiny next to any matmul, its grad accumulated in B."""
        f = self.tokens * self.hidden
        return cost_of(f, f, 0)

    def output_and_loss(self) -> StageCost:
        f = LOSS_FLOPS_PER_LOGIT * self.tokens * self.vocab
        return total([self._linear(self.hidden, self.vocab), cost_of(f, 2 * f, 0)])

    def mtp(self, moe: bool) -> StageCost:
        """An MTP module: its embedding lookup, the projection of [hidden; embedding], a transformer
        layer like the model's last one, and its own output layer and loss."""
        return total([self.embedding(), self._linear(2 * self.hidden, self.hidden), self.decoder(moe),
                      self.output_and_loss()])


__all__ = ["LOSS_FLOPS_PER_LOGIT", "ModelShape", "cost_of", "total"]
