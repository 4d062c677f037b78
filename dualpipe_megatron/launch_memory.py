"""Per-rank parameters and memory of a parsed Megatron job under DualPipe(V), without a model.

The launch plan (:mod:`.launch_plan`) needs what each pipeline rank will hold before anything
is built on a cluster. Parameters are counted from the arguments, stage by stage in our
placement (a rank holds two stages: DualPipeV's r and 2P-1-r, DualPipe's r of one copy and
P-1-r of the other). Weights, gradients and optimizer state use Megatron's own rule (its
``theoretical_memory_usage``: bf16 weights, fp32 gradients, fp32 main weights and Adam
moments, the last 12 bytes sharded over data parallel by the distributed optimizer; expert
parameters over the expert data-parallel group). Activations are the schedule simulator's
per-rank peak of live micro-batches, each stage weighted by the projection's saved bytes of a
DeepSeek-V3-shaped layer (:mod:`.projection`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from megatron.core.transformer.enums import LayerType

from .megatron.auto_layout import model_shape
from .megatron.topology import DualPipeLayout
from .projection.placement import Realistic, weighted_peak
from .projection.shapes import check_stage, dense_layers, stage_shape
from .schedules.ir import Schedule
from .schedules.model_shape import ModelShape

GIB = 2**30


@dataclass(frozen=True)
class Params:
    """Parameter counts as one rank holds them: replicated (norms), tensor-parallel shards, experts."""

    replicated: int = 0
    tensor: int = 0
    expert: int = 0

    def __add__(self, other: "Params") -> "Params":
        return Params(self.replicated + other.replicated, self.tensor + other.tensor, self.expert + other.expert)

    @property
    def total(self) -> int:
        return self.replicated + self.tensor + self.expert


def padded_vocab(args: argparse.Namespace) -> int | None:
    """The vocabulary as Megatron pads it (a multiple of --make-vocab-size-divisible-by x TP)."""
    if getattr(args, "padded_vocab_size", None):
        return args.padded_vocab_size
    if not args.vocab_size:
        return None
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-args.vocab_size // multiple) * multiple


def moe_pattern(args: argparse.Namespace) -> list[bool]:
    """Which decoder layers are MoE (Megatron's --moe-layer-freq: N or a 0/1 list)."""
    if not args.num_experts:
        return [False] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(args.num_layers)]
    return [bool(v) for v in freq]


class ParamCounter:
    """Parameters of each layer kind, whole (``shard=False``) or as one TP x EP rank holds them.

    Linear biases are left out (the DeepSeek-V3 template disables them); the expert bias is a
    buffer, not a parameter.
    """

    def __init__(self, args: argparse.Namespace, shard: bool = True) -> None:
        self.a = args
        self.tp = args.tensor_model_parallel_size if shard else 1
        ep = args.expert_model_parallel_size if shard else 1
        self.experts_here = (args.num_experts or 0) // ep
        self.etp = (args.expert_tensor_parallel_size or 1) if shard else 1
        self.norm = 1 if args.normalization == "RMSNorm" else 2
        self.vocab = padded_vocab(args)

    def _tensor(self, n: int) -> Params:
        return Params(tensor=n // self.tp)

    def attention(self) -> Params:
        a, h, n = self.a, self.a.hidden_size, self.a.num_attention_heads
        if a.multi_latent_attention:
            qk = a.qk_head_dim + a.qk_pos_emb_head_dim
            q = h * a.q_lora_rank + a.q_lora_rank * n * qk if a.q_lora_rank else h * n * qk
            kv = h * (a.kv_lora_rank + a.qk_pos_emb_head_dim) + a.kv_lora_rank * n * (a.qk_head_dim + a.v_head_dim)
            norms = (a.kv_lora_rank + (a.q_lora_rank or 0)) * self.norm if a.qk_layernorm else 0
            return Params(replicated=norms + h * self.norm) + self._tensor(q + kv + n * a.v_head_dim * h)
        d = a.kv_channels or h // n
        groups = a.num_query_groups if a.group_query_attention else n
        norms = 2 * d * self.norm if a.qk_layernorm else 0
        return Params(replicated=norms + h * self.norm) + self._tensor(h * (n + 2 * groups) * d + n * d * h)

    def _mlp(self, width: int) -> int:
        return self.a.hidden_size * width * (3 if self.a.swiglu else 2)

    def layer(self, moe: bool) -> Params:
        a, h = self.a, self.a.hidden_size
        norm = Params(replicated=h * self.norm)  # pre-MLP norm
        if not moe:
            return self.attention() + norm + self._tensor(self._mlp(a.ffn_hidden_size))
        shared = a.moe_shared_expert_intermediate_size or 0
        gate = h if shared and getattr(a, "moe_shared_expert_gate", False) else 0
        routed = self.experts_here * self._mlp(a.moe_ffn_hidden_size) // self.etp
        return (self.attention() + norm + Params(replicated=h * a.num_experts + gate, expert=routed)
                + self._tensor(self._mlp(shared)))

    def embedding(self) -> Params:
        a = self.a
        position = a.max_position_embeddings * a.hidden_size if a.position_embedding_type == "learned_absolute" else 0
        return Params(replicated=position) + self._tensor(self.vocab * a.hidden_size)

    def output(self) -> Params:
        """The final norm and, untied, the output layer (tied, it is the embedding's weight)."""
        table = 0 if not self.a.untie_embeddings_and_output_weights else self.vocab * self.a.hidden_size
        return Params(replicated=self.a.hidden_size * self.norm) + self._tensor(table)

    def mtp(self, moe: bool) -> Params:
        """An MTP module beyond the embedding and output layer it shares: two norms, the
        projection of [hidden; embedding], a layer like the model's last, its final norm."""
        h = self.a.hidden_size
        return Params(replicated=3 * h * self.norm) + self._tensor(2 * h * h) + self.layer(moe)

    def stage(self, types: list[LayerType], first_layer: int, pattern: list[bool]) -> Params:
        """One model stage holding ``types``, whose first decoder layer is ``first_layer``."""
        total, layer = Params(), first_layer
        for t in types:
            if t == LayerType.embedding:
                total += self.embedding()
            elif t == LayerType.decoder:
                total += self.layer(pattern[layer])
                layer += 1
            elif t == LayerType.mtp:
                total += self.mtp(pattern[-1])
            elif t == LayerType.loss:
                total += self.output()
        return total


def stage_params(args: argparse.Namespace, layout: DualPipeLayout, shard: bool = True) -> list[Params]:
    """Parameters of every model stage (one TP x EP rank's share with ``shard``)."""
    counter, pattern = ParamCounter(args, shard), moe_pattern(args)
    out, first = [], 0
    for types in layout.stage_layers:
        out.append(counter.stage(types, first, pattern))
        first += types.count(LayerType.decoder)
    return out


def rank_params(args: argparse.Namespace, layout: DualPipeLayout) -> list[Params]:
    """Parameters each pipeline rank holds: its stages'. A tied output layer adds none: both
    schedules put it on a rank that holds the embedding (our ties are local)."""
    stages, stage_map = stage_params(args, layout), layout.stage_map
    return [sum((stages[stage_map.stage(rank, c)] for c in range(stage_map.chunks)), Params())
            for rank in range(stage_map.ranks)]


def state_bytes(args: argparse.Namespace, params: Params) -> float:
    """Weights, gradients and optimizer state of ``params``: Megatron's bytes per parameter
    (18; 6 + 12/DP with the distributed optimizer, experts over expert data parallel)."""
    def per_param(dp: int) -> float:
        return 6 + 12 / dp if args.use_distributed_optimizer else 18

    expert_dp = args.world_size // (args.pipeline_model_parallel_size * args.expert_model_parallel_size
                                    * (args.expert_tensor_parallel_size or 1))
    return ((params.replicated + params.tensor) * per_param(args.data_parallel_size)
            + params.expert * per_param(max(expert_dp, 1)))


def projection_shapes(args: argparse.Namespace) -> tuple[ModelShape, ModelShape]:
    """The projection's whole model for these arguments (:func:`.megatron.auto_layout.model_shape`)
    and its 1/P stage of MoE layers, as many as the model's MoE layers per pipeline rank. The
    output layer is as wide as Megatron will pad it (the layout search, run before the tokenizer,
    takes ``--vocab-size`` as given)."""
    model = check_stage(replace(model_shape(args), vocab=padded_vocab(args)))
    dense_layers(model)  # the projection's model: dense layers first, then MoE
    moe_layers = sum(model.moe_layers())
    return model, stage_shape(model, max(1, round(moe_layers / args.pipeline_model_parallel_size)))


class GivenLayout(Realistic):
    """The projection's realistic placement with the job's own layers per stage (it otherwise
    picks its split itself): glue on the plan's side, the projection's API untouched."""

    def __init__(self, counts: list[int], *args: object) -> None:
        super().__init__(*args)
        self.given = counts

    def counts(self, sched: Schedule, auto_layout: bool) -> list[int]:
        return list(self.given)


def decoder_counts(layout: DualPipeLayout) -> list[int]:
    return [types.count(LayerType.decoder) for types in layout.stage_layers]


def activation_peaks(placement: Realistic, sched: Schedule, saved_bytes_per_unit: int) -> list[float]:
    """Each rank's peak live activation bytes: the simulator's count of live micro-batches per
    stage, weighted by the projection's per-stage saved bytes (in units of its 1/P stage)."""
    plan = placement.plan(sched, True, False)
    weight = {k: v * saved_bytes_per_unit for k, v in plan.activations.items()}
    return [float(weighted_peak(ops, weight)) for ops in sched.ops]


__all__ = ["GIB", "GivenLayout", "ParamCounter", "Params", "activation_peaks", "decoder_counts", "moe_pattern",
           "padded_vocab", "projection_shapes", "rank_params", "stage_params", "state_bytes"]
