"""The projection's shapes: DeepSeek-V3, its pipeline stages, and the small stages op costs are
measured on; all of them :class:`~..schedules.model_shape.ModelShape`, the one layer model.

A stage shape is a ModelShape of ``num_layers`` MoE layers and nothing else (no embedding,
dense layers, MTP or loss), as one expert-parallel rank runs it: ``experts / ep`` routed
experts live on the rank, and the rank's micro-batch of ``micro_batch x seq`` tokens sends
``topk`` copies of each token through the all-to-all. Measuring on a smaller shape and scaling
by FLOP count is how a CPU (or a single GPU) stands in for the full job.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..schedules.ir import ScheduleError
from ..schedules.model_shape import ModelShape


class ProjectionError(ValueError):
    """Bad input to the projection (shape, flags, op-cost file)."""


# DeepSeek-V3 (arXiv 2412.19437): 61 layers, the first 3 dense (FFN 18432), 7168 hidden, 128
# heads, MLA ranks 1536/512, 256 routed experts of width 2048 plus one shared, top-8, one MTP
# layer, vocabulary 129280; EP64 leaves 4 routed experts per rank; 4K sequence.
DEEPSEEK_V3 = ModelShape(num_layers=61, hidden=7168, seq=4096, vocab=129280, ffn=18432, heads=128, gated=True,
                         experts=256, topk=8, moe_ffn=2048, shared_ffn=2048, moe_layer_freq=(0,) * 3 + (1,) * 58,
                         mtp_layers=1, mla=True, q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128,
                         qk_pos_dim=64, v_head_dim=128, ep=64)


def check_stage(s: ModelShape) -> ModelShape:
    """``s`` if the projection's plain-torch layer (:mod:`.layer`) can stand for it: MLA with
    query compression, SwiGLU MoE with shared experts a whole number of experts wide, and a
    micro-batch whose ``tokens x topk`` copies split evenly over the rank's local experts."""
    why = [] if s.mla and s.q_lora_rank else ["MLA with q-LoRA"]
    if not (s.experts and s.shared_ffn and s.gated):
        why.append("SwiGLU MoE with a shared expert")
    if why:
        raise ProjectionError(f"the projection's layer model needs {' and '.join(why)}")
    if s.shared_ffn % s.expert_ffn:
        raise ProjectionError(f"shared expert width {s.shared_ffn} is not a whole number of "
                              f"{s.expert_ffn}-wide experts")
    if (s.tokens * s.topk) % s.local_experts:
        raise ProjectionError(f"tokens x topk ({s.tokens * s.topk}) must split evenly over "
                              f"{s.local_experts} local experts (balanced routing)")
    return s


def stage_shape(model: ModelShape, layers: int) -> ModelShape:
    """A pipeline stage of ``layers`` of ``model``'s MoE layers."""
    return check_stage(replace(model, num_layers=layers, moe_layer_freq=1, mtp_layers=0))


def whole_model(stage: ModelShape, num_layers: int, dense_layers: int, mtp_layers: int, vocab: int,
                dense_ffn: int) -> ModelShape:
    """The model whose MoE layers are ``stage``'s: ``dense_layers`` dense layers first, then MoE."""
    if not 0 <= dense_layers < num_layers:
        raise ProjectionError(f"dense layers ({dense_layers}) must be fewer than the {num_layers} layers")
    if min(num_layers, vocab, dense_ffn) < 1 or mtp_layers < 0:
        raise ProjectionError("num_layers, vocab and dense_ffn must be >= 1, mtp_layers >= 0")
    return replace(stage, num_layers=num_layers, vocab=vocab, ffn=dense_ffn, mtp_layers=mtp_layers,
                   moe_layer_freq=(0,) * dense_layers + (1,) * (num_layers - dense_layers))


def dense_layers(model: ModelShape) -> int:
    """Leading dense layers; the projection's model has only MoE layers after them."""
    pattern = model.moe_layers()
    dense = pattern.index(True) if True in pattern else len(pattern)
    if not all(pattern[dense:]):
        raise ProjectionError("the projection's model needs the dense layers first, then only MoE layers")
    return dense


# The op-cost file's ``shape`` (format dualpipe-op-costs/2): its keys, in order, and the field of
# each; ``shared_experts`` is ``shared_ffn`` in experts.
_FILE_KEYS = {"hidden": "hidden", "heads": "heads", "q_lora": "q_lora_rank", "kv_lora": "kv_lora_rank",
              "qk_nope": "qk_head_dim", "qk_rope": "qk_pos_dim", "v_head": "v_head_dim", "experts": "experts",
              "ep": "ep", "topk": "topk", "expert_ffn": "moe_ffn", "shared_experts": None, "seq": "seq",
              "mbs": "micro_batch", "layers": "num_layers"}


def shape_to_json(s: ModelShape) -> dict[str, int]:
    """A stage shape as the op-cost file writes it."""
    return {key: getattr(s, name) if name else s.shared_ffn // s.expert_ffn for key, name in _FILE_KEYS.items()}


def shape_from_json(obj: Any) -> ModelShape:
    """A stage shape from an op-cost file (DeepSeek-V3's for what the file does not record)."""
    try:
        given = {name: int(obj[key]) for key, name in _FILE_KEYS.items() if name}
        shared = int(obj["shared_experts"]) * given["moe_ffn"]
        return check_stage(replace(DEEPSEEK_V3_STAGE, **given, shared_ffn=shared))
    except (KeyError, TypeError, ValueError, ScheduleError) as exc:
        raise ProjectionError(f"malformed shape {obj!r}: {exc!r}") from None


# DualPipe's stage: 4 MoE layers (61 layers / PP16, about 4 per rank).
DEEPSEEK_V3_STAGE = stage_shape(DEEPSEEK_V3, 4)

PRESETS: dict[str, ModelShape] = {
    # One GPU holds a full-width rank's share of two layers (~0.8 GB of bf16 weights each).
    "h200": stage_shape(DEEPSEEK_V3, 2),
    # Hidden and expert widths 1/14 of DeepSeek-V3's, heads 1/16, per-head widths 1/2,
    # sequence 1/16, routing kept: ~1.5 GFLOP per forward, tens of ms on one core.
    "cpu": check_stage(replace(DEEPSEEK_V3_STAGE, num_layers=1, hidden=512, heads=8, q_lora_rank=128,
                               kv_lora_rank=64, qk_head_dim=64, qk_pos_dim=32, v_head_dim=64, moe_ffn=144,
                               shared_ffn=144, seq=256)),
    # For tests: runs in milliseconds.
    "tiny": check_stage(replace(DEEPSEEK_V3_STAGE, num_layers=1, hidden=64, heads=2, q_lora_rank=32,
                                kv_lora_rank=16, qk_head_dim=16, qk_pos_dim=8, v_head_dim=16, experts=16, ep=4,
                                topk=2, moe_ffn=32, shared_ffn=32, seq=32)),
}


__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V3_STAGE", "PRESETS", "ProjectionError", "check_stage", "dense_layers",
           "shape_from_json", "shape_to_json", "stage_shape", "whole_model"]
