"""Layer shapes: DeepSeek-V3's, and the scaled-down ones op costs are measured on.

One shape describes a pipeline chunk of ``layers`` MoE layers as one
expert-parallel rank runs it: ``experts / ep`` routed experts live on the rank,
and the rank's micro-batch of ``mbs * seq`` tokens sends ``topk`` copies of
each token through the all-to-all. Measuring on a smaller shape and scaling by
FLOP count is how a CPU (or a single GPU) stands in for the full job.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any


class ProjectionError(ValueError):
    """Bad input to the projection (shape, flags, op-cost file)."""


@dataclass(frozen=True)
class LayerShape:
    """Dimensions of one MoE transformer layer with multi-head latent attention (MLA)."""

    hidden: int
    heads: int
    q_lora: int  # MLA query compression width
    kv_lora: int  # MLA key/value compression width
    qk_nope: int  # per-head query/key width without rotary part
    qk_rope: int  # per-head rotary width (key part shared by all heads)
    v_head: int
    experts: int  # routed experts in the whole model (router width)
    ep: int  # expert-parallel ranks; each holds experts // ep of them
    topk: int
    expert_ffn: int
    shared_experts: int
    seq: int
    mbs: int
    layers: int  # MoE layers in the chunk

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ProjectionError(f"shape {f.name} must be >= 1, got {getattr(self, f.name)}")
        if self.experts % self.ep:
            raise ProjectionError(f"experts ({self.experts}) must divide evenly over ep ({self.ep})")
        if self.topk > self.experts:
            raise ProjectionError(f"topk ({self.topk}) exceeds experts ({self.experts})")
        if (self.tokens * self.topk) % self.local_experts:
            raise ProjectionError(
                f"tokens x topk ({self.tokens * self.topk}) must split evenly over "
                f"{self.local_experts} local experts (balanced routing)")

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return self.mbs * self.seq

    def to_json_obj(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json_obj(cls, obj: Any) -> "LayerShape":
        try:
            return cls(**{f.name: int(obj[f.name]) for f in fields(cls)})
        except (KeyError, TypeError, ValueError) as exc:
            raise ProjectionError(f"malformed shape {obj!r}: {exc!r}") from None


# DeepSeek-V3 (arXiv 2412.19437): 7168 hidden, 128 heads, MLA ranks 1536/512, 256 routed
# experts of width 2048 plus one shared, top-8; EP64 leaves 4 routed experts per rank;
# 4K sequence, and a DualPipe chunk of 4 MoE layers (61 layers / PP16, about 4 per rank).
DEEPSEEK_V3 = LayerShape(hidden=7168, heads=128, q_lora=1536, kv_lora=512, qk_nope=128,
                         qk_rope=64, v_head=128, experts=256, ep=64, topk=8, expert_ffn=2048,
                         shared_experts=1, seq=4096, mbs=1, layers=4)

PRESETS: dict[str, LayerShape] = {
    # One GPU holds a full-width rank's share of two layers (~0.8 GB of bf16 weights each).
    "h200": replace(DEEPSEEK_V3, layers=2),
    # Hidden and expert widths 1/14 of DeepSeek-V3's, heads 1/16, per-head widths 1/2,
    # sequence 1/16, routing kept: ~1.5 GFLOP per forward, tens of ms on one core.
    "cpu": LayerShape(hidden=512, heads=8, q_lora=128, kv_lora=64, qk_nope=64, qk_rope=32,
                      v_head=64, experts=256, ep=64, topk=8, expert_ffn=144, shared_experts=1,
                      seq=256, mbs=1, layers=1),
    # For tests: runs in milliseconds.
    "tiny": LayerShape(hidden=64, heads=2, q_lora=32, kv_lora=16, qk_nope=16, qk_rope=8,
                       v_head=16, experts=16, ep=4, topk=2, expert_ffn=32, shared_experts=1,
                       seq=32, mbs=1, layers=1),
}


__all__ = ["DEEPSEEK_V3", "LayerShape", "PRESETS", "ProjectionError"]
