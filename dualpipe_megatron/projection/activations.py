"""Activation bytes a Megatron-Core layer keeps for its backward, term by term.

Each term is bytes per token (one sequence position of one micro-batch) of one tensor, or of
one group of tensors, autograd keeps from a forward until its backward, at TP = 1; its
``split`` says how tensor (and sequence) parallelism shares it out, and its ``module`` which
``--recompute-modules`` entry drops it (it is then recomputed in the backward). Every term is
written once here, with its source:

- ``local`` (``--transformer-impl local``, what runs on a CPU): the measured graph of
  Megatron 0.19.2's local layers (and our CPU MLA core, :mod:`..megatron.mla_attention`), read
  with a saved-tensor hook per module; ``bench/activation_estimate.py`` checks whole ranks
  against the activation meter.
- ``transformer_engine`` (the GPU default): what Transformer Engine's fused modules and
  Megatron's fused kernels save, from their code (docs/performance.md, "Activation memory",
  lists each with its file); not measured here (``scripts/gpu_check.sh`` section
  ``activation_memory`` does, on a GPU).

Left out everywhere: tensors below one byte per token (rotary tables, masks, token ids are
kept where they are per token), the pipeline's send and receive buffers, gradients and
temporaries (not saved tensors), and allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable

from ..schedules.model_shape import ModelShape

FP32, INT64 = 4, 8
IMPLS = ("local", "transformer_engine")
SELECTIVE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "mlp", "moe", "moe_act", "shared_experts")
LOCAL_SOURCE = "measured graph, local spec"
TE_SOURCE = "Transformer Engine / Megatron fused-kernel code"


@dataclass(frozen=True)
class Term:
    """One saved tensor (or group) of a layer: bytes per token at TP = 1."""

    name: str
    per_token: float
    split: str = "tp"  # "tp": shared over TP ranks; "seq": only under sequence parallelism
    module: str | None = None  # the --recompute-modules entry that drops it
    source: str = LOCAL_SOURCE
    weight_input: bool = False  # a linear's input: its deferred weight gradient (W) holds it


@dataclass(frozen=True)
class Options:
    """What decides the saved bytes beside the model's shape: implementation, precision,
    recompute and parallelism (from Megatron's flags, :func:`..launch_memory.activation_options`)."""

    impl: str = "transformer_engine"
    act_bytes: int = 2  # bf16/fp16; 4 for fp32
    fp8: bool = False  # --fp8-format: Transformer Engine keeps its linears' inputs in FP8
    modules: frozenset[str] = field(default_factory=frozenset)  # selective recompute
    full: tuple[str, int] | None = None  # full recompute: (method "uniform"|"block", --recompute-num-layers)
    tp: int = 1
    sp: bool = False
    cp: int = 1
    softmax_fp32: bool = False  # --attention-softmax-in-fp32 (unfused attention only)
    fused_swiglu: bool = True  # --bias-swiglu-fusion (Megatron's default): SwiGLU keeps only its input
    fp8_act_input: bool = False  # --activation-func-fp8-input-store: SwiGLU's input in FP8
    permute_fusion: bool = False  # --moe-permute-fusion: TE's [tokens, 2E+1] int32 map
    te_cross_entropy: bool = False  # --cross-entropy-fusion-impl te: bf16 logits instead of fp32

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"transformer implementation {self.impl!r}: one of {', '.join(IMPLS)}")
        unknown = set(self.modules) - set(SELECTIVE_MODULES)
        if unknown:
            raise ValueError(f"--recompute-modules {sorted(unknown)}: Megatron 0.19 has {', '.join(SELECTIVE_MODULES)}")

    @property
    def te(self) -> bool:
        return self.impl == "transformer_engine"

    def stored(self) -> float:
        """Bytes per element of a linear's saved input: FP8 under --fp8-format (Transformer Engine
        quantizes it for the weight gradient), else the activation dtype."""
        return 1 if self.fp8 and self.te else self.act_bytes


def _norm(o: Options, width: int, name: str) -> list[Term]:
    """A norm inside an attention block (q/kv latents, final, MTP): its own saved tensors; its
    output is the next linear's input, counted there. Local: torch's RMSNorm computes in fp32 and
    keeps the fp32 input and normalized values and the fp32 reciprocal RMS. Transformer Engine:
    the input in the activation dtype and fp32 rsigma."""
    if o.te:
        return [Term(name, width * o.act_bytes + FP32, "seq", None, TE_SOURCE)]
    return [Term(name, 2 * width * FP32 + FP32, "seq")]


def _block_norm(o: Options, width: int, name: str, fused: bool) -> list[Term]:
    """A layer's input or pre-MLP norm and its output (the next linear's input), as
    ``--recompute-modules layernorm`` treats them: Megatron recomputes a norm that is a module of
    its own (never one Transformer Engine fuses into the next linear, ``fused``), keeping its
    input and discarding its output. Local: the fp32 internals go, the kept input replaces the
    discarded output. Transformer Engine: the output goes (its input is kept either way), unless
    FP8, where the next linears keep their own FP8 copies of it, which the recompute leaves."""
    out = f"{name} output (linear input)"
    if o.te:
        return [Term(name, width * o.act_bytes + FP32, "seq", None, TE_SOURCE),
                Term(out, width * o.stored(), "seq", None if fused or o.fp8 else "layernorm", TE_SOURCE, True)]
    return [Term(name, 2 * width * FP32 + FP32, "seq", "layernorm"), Term(out, width * o.act_bytes, "seq", weight_input=True)]


def _rope(s: ModelShape, o: Options, rotary: int) -> list[Term]:
    """Local rotary embedding keeps cos and sin for q and k per position (shared by the micro-batch)."""
    if o.te:
        return []
    return [Term("rotary tables", 4 * rotary * o.act_bytes / s.micro_batch, "none")]


def _scores(s: ModelShape, o: Options, heads: int) -> list[Term]:
    """Local (unfused) attention keeps the softmax probabilities (fp32 under
    --attention-softmax-in-fp32, then also a copy in the activation dtype for the value product)
    and the causal mask; a flash kernel keeps none of them."""
    if o.te:
        return []
    probs = heads * s.seq * (FP32 + o.act_bytes if o.softmax_fp32 and o.act_bytes != FP32 else o.act_bytes)
    return [Term("softmax probabilities", probs, "tp", "core_attn"),
            Term("causal mask", s.seq / s.micro_batch, "none", "core_attn")]


def attention(s: ModelShape, o: Options) -> list[Term]:
    """Input norm, attention (MLA or multi-head/grouped-query) and output projection's input."""
    a, n = o.act_bytes, s.heads
    # Transformer Engine fuses the input norm into the qkv linear, except under MLA (two consumers).
    terms = _block_norm(o, s.hidden, "input norm", fused=not s.mla)
    if s.mla:
        qk = s.qk_head_dim + s.qk_pos_dim
        q_lora = s.q_lora_rank or 0
        if o.te and o.fp8:  # the q and kv down-projections each keep an FP8 copy of the norm output
            terms.append(Term("second FP8 copy of the input norm output", s.hidden, "seq", None, TE_SOURCE, True))
        if q_lora:
            terms += _norm(o, q_lora, "q latent norm") + [Term("q up-projection input", q_lora * o.stored(), "seq", weight_input=True)]
        terms += _norm(o, s.kv_lora_rank, "kv latent norm")
        terms.append(Term("kv up-projection input", s.kv_lora_rank * o.stored(), "seq", weight_input=True))
        terms += _rope(s, o, s.qk_pos_dim)
        terms.append(Term("q, k, v (attention core inputs)", n * (2 * qk + s.v_head_dim) * a, "tp", "mla_up_proj",
                          TE_SOURCE if o.te else LOCAL_SOURCE))
        heads_out = n * s.v_head_dim
    else:
        d = s.kv_channels or s.hidden // n
        groups = s.query_groups or n
        terms += _rope(s, o, d)
        # Local: the fused qkv output, the rotated q and k, and the batched-matmul copies of q and k
        # (measured as 5 x heads x head dim with groups = heads). TE: q, k, v once.
        qkv = (2 * n + 3 * groups) * d if not o.te else (n + 2 * groups) * d
        terms.append(Term("q, k, v (attention core inputs)", qkv * a, "tp", None,
                          TE_SOURCE if o.te else LOCAL_SOURCE))
        heads_out = n * d
    terms += _scores(s, o, n)
    if o.te:
        terms.append(Term("softmax log-sum-exp", n * FP32, "tp", "core_attn", TE_SOURCE))
    # The flash kernel keeps its output, which the projection saves as its input (the same tensor).
    terms.append(Term("attention output (projection input)", heads_out * a, "tp", None,
                      TE_SOURCE if o.te else LOCAL_SOURCE, True))
    return terms


def _swiglu(o: Options, width: int, copies: float, name: str, module: str | None,
            down_module: str | None = None) -> list[Term]:
    """A gated MLP's activation and its down-projection's input, for ``copies`` rows per token.
    Megatron's fused SwiGLU keeps only its input (the fc1 output, 2 x width; FP8 under
    --activation-func-fp8-input-store); unfused, the fc1 output, silu and product tensors
    (4 x width, measured). ``down_module`` drops the down-projection's input alone (moe_act)."""
    act = 2 * width * (1 if o.fp8_act_input else o.act_bytes) if o.fused_swiglu else 4 * width * o.act_bytes
    return [Term(f"{name} activation", copies * act, "tp", module, TE_SOURCE if o.te else LOCAL_SOURCE),
            Term(f"{name} down-projection input", copies * width * o.stored(), "tp", down_module or module,
                 TE_SOURCE if o.te else LOCAL_SOURCE, True)]


def mlp(s: ModelShape, o: Options, moe: bool) -> list[Term]:
    """Pre-MLP norm, then the dense MLP or the MoE layer (router, dispatch, experts, shared experts)."""
    # Transformer Engine fuses the pre-MLP norm into a dense MLP's first linear, not into MoE.
    terms = _block_norm(o, s.hidden, "pre-MLP norm", fused=not moe)
    if not moe:
        if s.gated:
            return terms + _swiglu(o, s.dense_ffn, 1, "MLP", "mlp")
        return terms + [Term("MLP activation", 2 * s.dense_ffn * o.act_bytes, "tp", "mlp"),
                        Term("MLP down-projection input", s.dense_ffn * o.stored(), "tp", "mlp", weight_input=True)]
    k, fe = s.topk, s.expert_ffn
    maps = ((2 * s.experts + 1) * 4 if o.permute_fusion else 2 * k * INT64) if o.te else 5 * k * INT64
    terms += [Term("router logits, scores, top-k", s.experts * FP32 + k * (INT64 + FP32) + FP32, "seq", "moe"),
              Term("token permutation maps", maps, "seq", "moe", TE_SOURCE if o.te else LOCAL_SOURCE),
              Term("dispatched tokens (experts' input)", k * s.hidden * o.stored(), "seq", "moe",
                   TE_SOURCE if o.te else LOCAL_SOURCE, True),
              Term("routing probabilities", k * FP32, "seq", "moe")]
    terms += _swiglu(o, fe, k, "expert", "moe", "moe_act")
    if s.shared_ffn:
        terms += _swiglu(o, s.shared_ffn, 1, "shared expert", "shared_experts")
    # Recomputing the whole MoE layer drops the shared experts and the experts' activations too.
    return [replace(t, module="moe") if t.module in ("shared_experts", "moe_act") and "moe" in o.modules else t
            for t in terms]


def head(s: ModelShape, o: Options) -> list[Term]:
    """Final norm, output layer input and the loss's fp32 logits (each output head)."""
    return _norm(o, s.hidden, "final norm") + [
        Term("output layer input", s.hidden * o.stored(), "seq", None, TE_SOURCE if o.te else LOCAL_SOURCE, True),
        Term("logits (cross entropy)", s.vocab * (o.act_bytes if o.te_cross_entropy else FP32), "tp")]


def mtp(s: ModelShape, o: Options, moe: bool) -> list[Term]:
    """One MTP module: norms of the hidden state and of the shifted embedding, the projection of
    both, a transformer layer like the model's last, and its own output head."""
    return (_norm(o, s.hidden, "MTP hidden norm") + _norm(o, s.hidden, "MTP embedding norm")
            + [Term("MTP projection input", 2 * s.hidden * o.stored(), "seq", weight_input=True)]
            + attention(s, o) + mlp(s, o, moe) + head(s, o))


def kept(terms: Iterable[Term], o: Options, weight_inputs: bool = False) -> float:
    """Bytes per token the terms keep on one rank: recomputed ones dropped, parallelism applied.
    With ``weight_inputs``, what a backward that left its weight gradients for later (B then W)
    holds until W: every linear's input, the recomputed ones rebuilt by that backward."""
    total = 0.0
    for t in terms:
        if weight_inputs and not t.weight_input:
            continue
        if not weight_inputs and t.module is not None and t.module in o.modules:
            continue
        share = o.tp if t.split == "tp" or (t.split == "seq" and o.sp) else 1
        total += t.per_token / share
    return total


def tokens(s: ModelShape, o: Options) -> int:
    """Tokens of one micro-batch on one rank (context parallelism splits the sequence)."""
    return s.micro_batch * s.seq // o.cp


def layer_bytes(s: ModelShape, o: Options, moe: bool, weight_inputs: bool = False) -> float:
    """One decoder layer's saved bytes for one micro-batch (selective recompute applied), or
    with ``weight_inputs`` what its deferred weight gradients hold (:func:`kept`)."""
    return kept(attention(s, o) + mlp(s, o, moe), o, weight_inputs) * tokens(s, o)


def layer_input_bytes(s: ModelShape, o: Options) -> float:
    """What full recompute keeps of a group of layers: its input hidden states."""
    return s.hidden * o.act_bytes * tokens(s, o) / (o.tp if o.sp else 1)


@dataclass(frozen=True)
class ChunkBytes:
    """A model chunk's saved bytes per micro-batch; the extra a backward rebuilds at once under
    full recompute (one group of layers, alive only while its backward runs); and the bytes of
    the chunk's output heads (loss, MTP), which that backward has already freed by then."""

    kept: float
    transient: float
    heads: float = 0.0
    held: float = 0.0  # from a B that left its weight gradients until their W (:func:`kept`)

    @property
    def rebuilt(self) -> float:
        """What a backward on this chunk adds to the live bytes at its highest."""
        return max(0.0, self.transient - self.heads)


def decoder_bytes(s: ModelShape, o: Options, moe_layers: list[bool]) -> ChunkBytes:
    """The decoder layers of one chunk (their MoE pattern), under ``o``'s full recompute if any:
    ``uniform`` N checkpoints groups of N layers, ``block`` N the chunk's first N layers; and what
    their deferred weight gradients hold."""
    per = [layer_bytes(s, o, m) for m in moe_layers]
    held = sum(layer_bytes(s, o, m, weight_inputs=True) for m in moe_layers)
    if o.full is None or not per:
        return ChunkBytes(sum(per), 0.0, 0.0, held)
    method, n = o.full
    inputs = layer_input_bytes(s, o)
    if method == "uniform":
        groups = [per[i:i + n] for i in range(0, len(per), n)]
        return ChunkBytes(len(groups) * inputs, max(sum(g) for g in groups), 0.0, held)
    # The chunk's first n layers: their backward runs last, after the rest have freed theirs.
    recomputed, rest = per[:n], per[n:]
    return ChunkBytes(len(recomputed) * inputs + sum(rest), max(0.0, max(recomputed, default=0.0) - sum(rest)),
                      0.0, held)


def embedding_bytes(s: ModelShape, o: Options) -> float:
    """The embedding's saved token ids (int64)."""
    return INT64 * tokens(s, o)


def head_bytes(s: ModelShape, o: Options, weight_inputs: bool = False) -> float:
    return kept(head(s, o), o, weight_inputs) * tokens(s, o)


def mtp_bytes(s: ModelShape, o: Options, moe: bool, weight_inputs: bool = False) -> float:
    return kept(mtp(s, o, moe), o, weight_inputs) * tokens(s, o)


__all__ = ["ChunkBytes", "IMPLS", "Options", "SELECTIVE_MODULES", "Term", "attention", "decoder_bytes",
           "embedding_bytes", "head", "head_bytes", "kept", "layer_bytes", "layer_input_bytes", "mlp", "mtp",
           "mtp_bytes", "tokens"]
