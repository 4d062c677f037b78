"""Per-rank parameters and memory of a parsed Megatron job under DualPipe(V), without a model.

The launch plan (:mod:`.job`) needs what each pipeline rank will hold before anything
is built on a cluster. Parameters are counted from the arguments, stage by stage in our
placement (a rank holds two stages: DualPipeV's r and 2P-1-r, DualPipe's r of one copy and
P-1-r of the other). Weights, gradients and optimizer state use Megatron's own rule (its
``theoretical_memory_usage``: bf16 weights, fp32 gradients, fp32 main weights and Adam
moments, the last 12 bytes sharded over data parallel by the distributed optimizer; expert
parameters over the expert data-parallel group). Activations are the schedule simulator's
per-rank peak of live micro-batches of the op order the job runs, each stage weighted by its own
layers' saved bytes under the job's implementation, precision and recompute options
(:mod:`.projection.activations`), plus what a backward rebuilds at once under full recompute.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from megatron.core.transformer.enums import LayerType

from ..megatron.auto_layout import model_shape
from ..projection import activations
from ..projection.activations import ChunkBytes
from ..projection.placement import Realistic
from ..projection.shapes import check_stage, dense_layers, stage_shape
from ..schedules.ir import FB, B, F, Op, Schedule, W, halves
from ..schedules.model_shape import ModelShape

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


def stage_params(args: argparse.Namespace, stage_layers: list[list[LayerType]], shard: bool = True) -> list[Params]:
    """Parameters of every model stage (one TP x EP rank's share with ``shard``)."""
    counter, pattern = ParamCounter(args, shard), moe_pattern(args)
    out, first = [], 0
    for types in stage_layers:
        out.append(counter.stage(types, first, pattern))
        first += types.count(LayerType.decoder)
    return out


def rank_params(args: argparse.Namespace, stage_layers: list[list[LayerType]], sched: Schedule) -> list[Params]:
    """Parameters each pipeline rank holds: its stages' under ``sched``'s placement (DualPipe:
    one stage of each copy). A tied output layer adds none under our schedules (a rank holding
    the loss holds the embedding)."""
    stages = stage_params(args, stage_layers)
    return [sum((stages[s] for _, s in sched.stages_on(rank)), Params()) for rank in range(sched.ranks)]


_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def _dtype_bytes(dtype: object) -> int:
    """A dtype flag's bytes, as parsed (a name) or as Megatron's validate_args leaves it (a torch dtype)."""
    return _DTYPE_BYTES[dtype] if isinstance(dtype, str) else dtype.itemsize


def state_bytes(args: argparse.Namespace, params: Params) -> float:
    """Weights, gradients and optimizer state of ``params``: Megatron's bytes per parameter
    (18: bf16 weights, fp32 gradients, fp32 main weights and Adam moments; the last 12 over DP
    with the distributed optimizer, experts' over expert data parallel), with the dtypes
    ``--use-precision-aware-optimizer`` sets (``--main-grads-dtype``, ``--main-params-dtype``,
    ``--exp-avg-dtype``, ``--exp-avg-sq-dtype``)."""
    grads, optimizer = 4, 12
    if getattr(args, "use_precision_aware_optimizer", False):
        grads = _dtype_bytes(args.main_grads_dtype)
        optimizer = sum(_dtype_bytes(d) for d in (args.main_params_dtype, args.exp_avg_dtype, args.exp_avg_sq_dtype))

    def per_param(dp: int) -> float:
        return 2 + grads + optimizer / (dp if args.use_distributed_optimizer else 1)

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


def decoder_counts(stage_layers: list[list[LayerType]]) -> list[int]:
    return [types.count(LayerType.decoder) for types in stage_layers]


def activation_options(args: argparse.Namespace) -> activations.Options:
    """The flags that decide saved bytes: ``--transformer-impl``, ``--bf16``/``--fp16``,
    ``--fp8-format``, ``--recompute-granularity`` with ``--recompute-modules`` (Megatron's default
    ``core_attn``) or ``--recompute-method``/``--recompute-num-layers``, TP, SP and CP, and the
    fusions that change what is kept (softmax in fp32, SwiGLU fusion, permute fusion, Transformer
    Engine's cross entropy)."""
    granularity = args.recompute_granularity
    modules = frozenset(args.recompute_modules or ["core_attn"]) if granularity == "selective" else frozenset()
    full = None
    if granularity == "full":
        if args.recompute_method not in ("uniform", "block") or not args.recompute_num_layers:
            raise ValueError("--recompute-granularity full needs --recompute-method uniform|block and "
                             "--recompute-num-layers")
        full = (args.recompute_method, args.recompute_num_layers)
    impl = "local" if args.transformer_impl == "local" else "transformer_engine"
    return activations.Options(
        impl=impl, act_bytes=2 if (args.bf16 or args.fp16) else 4, fp8=bool(args.fp8), modules=modules, full=full,
        tp=args.tensor_model_parallel_size, sp=bool(args.sequence_parallel), cp=args.context_parallel_size,
        softmax_fp32=bool(args.attention_softmax_in_fp32), rms_norm=args.normalization == "RMSNorm",
        fused_swiglu=bool(args.bias_swiglu_fusion),
        permute_fusion=bool(args.moe_permute_fusion),
        te_cross_entropy=bool(args.cross_entropy_loss_fusion) and args.cross_entropy_fusion_impl == "te")


def activation_shape(args: argparse.Namespace) -> ModelShape:
    """The model as the saved-bytes terms read it (the vocabulary as Megatron pads it)."""
    return replace(model_shape(args), vocab=padded_vocab(args))


def stage_activations(args: argparse.Namespace, stage_layers: list[list[LayerType]]) -> list[ChunkBytes]:
    """Saved bytes of one micro-batch on each model stage of ``stage_layers`` (any layout: ours,
    Megatron's looped one), and what its backward rebuilds at once under full recompute."""
    shape, options, pattern = activation_shape(args), activation_options(args), moe_pattern(args)
    out, first = [], 0
    for types in stage_layers:
        decoders = types.count(LayerType.decoder)
        chunk = activations.decoder_bytes(shape, options, pattern[first:first + decoders])
        mtp, loss = types.count(LayerType.mtp), types.count(LayerType.loss)
        heads = (activations.mtp_bytes(shape, options, pattern[-1]) * mtp
                 + activations.head_bytes(shape, options) * loss)
        held = (activations.mtp_bytes(shape, options, pattern[-1], weight_inputs=True) * mtp
                + activations.head_bytes(shape, options, weight_inputs=True) * loss)
        embedding = activations.embedding_bytes(shape, options) * types.count(LayerType.embedding)
        # Rebuilding the layers comes after every head's backward; an MTP body's after its own head's.
        rebuilt = max(chunk.rebuilt - heads, 0.0)
        if mtp:
            rebuilt = max(rebuilt, activations.mtp_rebuilt(shape, options, pattern[-1])
                          - activations.head_bytes(shape, options))
        out.append(ChunkBytes(chunk.kept + heads + embedding, rebuilt, chunk.held + held, chunk.held_last,
                              embedding + (chunk.step or heads)))
        first += decoders
    return out


def overlapped_pairs(args: argparse.Namespace, schedule: str, megatron_overlap: bool | None = None) -> bool:
    """Whether ``schedule``'s F&B pairs run layer by layer for this job: a MoE model with expert
    parallelism under our MoE F&B overlap (on unless --no-dualpipe-moe-overlap), or Megatron's
    schedule under --overlap-moe-expert-parallel-comm (``megatron_overlap`` when given). Full
    recompute and recompute of the whole ``moe`` module turn the overlap off (docs/deepseek_v3.md)."""
    if not args.num_experts or args.expert_model_parallel_size < 2:
        return False
    options = activation_options(args)
    if options.full is not None or "moe" in options.modules:
        return False
    if schedule in ("dualpipe", "dualpipev"):
        return getattr(args, "dualpipe_moe_overlap", True)
    if megatron_overlap is None:
        megatron_overlap = bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
    return megatron_overlap


def activation_peaks(sched: Schedule, stages: list[ChunkBytes], overlapped: bool = False) -> list[float]:
    """Each rank's peak saved bytes under ``sched``'s op order (:func:`_live_peak`); with
    ``overlapped`` its F&B pairs run layer by layer (the MoE F&B overlap)."""
    return [_live_peak(ops, stages, overlapped) for ops in sched.ops]


def rank_memory(args: argparse.Namespace, sched: Schedule, stage_layers: list[list[LayerType]], overlapped: bool
                ) -> tuple[list[float], list[float]]:
    """Each rank's peak activation bytes under ``sched``, and its total with its stages' weights,
    gradients and optimizer state."""
    peaks = activation_peaks(sched, stage_activations(args, stage_layers), overlapped)
    state = [state_bytes(args, params) for params in rank_params(args, stage_layers, sched)]
    return peaks, [a + b for a, b in zip(peaks, state)]


def _live_peak(ops: list[Op], stages: list[ChunkBytes], overlapped: bool = False) -> float:
    """The most bytes a rank's ops keep at once. An F adds its stage's ``kept``. A B adds, while
    it runs, what it rebuilds (recompute), beside the ``held`` it has already left for its W
    under full recompute; then it frees ``kept``, or, leaving its weight gradients for a W,
    swaps it for ``held`` (the linears' inputs and output gradients) until that W. An F&B pair
    run layer by layer (``overlapped``) is at its highest one forward layer ahead of its
    backward; otherwise the F runs whole first. Live micro-batches are the simulator's (d,s,m)
    from F to W."""
    live = peak = 0.0
    for op in ops:
        backs = [h for h in halves(op) if isinstance(h, B)]
        if overlapped and isinstance(op, FB):
            peak = max(peak, live + stages[op.f.key.s].step + stages[op.b.key.s].rebuilt)
            live += stages[op.f.key.s].kept
        else:
            live += sum(stages[h.key.s].kept for h in halves(op) if isinstance(h, F))
            peak = max(peak, live)
            for h in backs:
                stage = stages[h.key.s]
                building = stage.held - stage.held_last if not h.w and stage.held_last else 0.0
                peak = max(peak, live + building + stage.rebuilt)
        for h in backs:
            if not h.w:
                live += stages[h.key.s].held - stages[h.key.s].kept
                peak = max(peak, live)
        for h in halves(op):
            if isinstance(h, W):
                live -= stages[h.key.s].held
            elif isinstance(h, B) and h.w:
                live -= stages[h.key.s].kept
    return peak


__all__ = ["GIB", "GivenLayout", "ParamCounter", "Params", "activation_options", "activation_peaks",
           "activation_shape", "decoder_counts", "moe_pattern", "overlapped_pairs", "padded_vocab", "projection_shapes",
           "rank_params",
           "stage_activations", "stage_params", "state_bytes"]
