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
    # A linear's input: a weight gradient left for later (W) holds it and the gradient of the
    # linear's output, ``grad_out`` bytes per token; None for any other tensor.
    grad_out: float | None = None


@dataclass(frozen=True)
class Options:
    """What decides the saved bytes beside the model's shape: implementation, precision,
    recompute and parallelism (from Megatron's flags, :func:`...plan.memory.activation_options`)."""

    impl: str = "transformer_engine"
    act_bytes: int = 2  # bf16/fp16; 4 for fp32
    fp8: bool = False  # --fp8-format: Transformer Engine keeps its linears' inputs in FP8
    modules: frozenset[str] = field(default_factory=frozenset)  # selective recompute
    full: tuple[str, int] | None = None  # full recompute: (method "uniform"|"block", --recompute-num-layers)
    tp: int = 1
    sp: bool = False
    cp: int = 1
    softmax_fp32: bool = False  # --attention-softmax-in-fp32 (unfused attention only)
    rms_norm: bool = True  # --normalization RMSNorm (else LayerNorm)
    fused_swiglu: bool = True  # --bias-swiglu-fusion (Megatron's default): SwiGLU keeps only its input
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


def _own_norm_bytes(o: Options, width: int) -> int:
    """What a norm keeps of its own. Local RMSNorm (torch's) computes in fp32 and keeps the fp32
    input and normalized values and the fp32 reciprocal RMS; local LayerNorm (torch's fused one)
    its input and mean and reciprocal std in the activation dtype. Transformer Engine: the input in
    the activation dtype and fp32 rsigma (and mu for LayerNorm)."""
    if o.te:
        return width * o.act_bytes + FP32 * (1 if o.rms_norm else 2)
    return 2 * width * FP32 + FP32 if o.rms_norm else (width + 2) * o.act_bytes


def _norm(o: Options, width: int, name: str) -> list[Term]:
    """A norm inside an attention block (q/kv latents, final, MTP): its own saved tensors; its
    output is the next linear's input, counted there."""
    return [Term(name, _own_norm_bytes(o, width), "seq", None, TE_SOURCE if o.te else LOCAL_SOURCE)]


def _block_norm(o: Options, width: int, name: str, fused: bool, out_width: int) -> list[Term]:
    """A layer's input or pre-MLP norm and its output (the next linear's input), as
    ``--recompute-modules layernorm`` treats them: Megatron recomputes a norm that is a module of
    its own (never one Transformer Engine fuses into the next linear, ``fused``), keeping its
    input and discarding its output. Local: the fp32 internals go, the kept input replaces the
    discarded output. Transformer Engine: the output goes (its input is kept either way), unless
    FP8, where the next linears keep their own FP8 copies of it, which the recompute leaves.
    ``out_width``: the outputs of the linears that read it."""
    grad = out_width * o.act_bytes
    out = f"{name} output (linear input)"
    if o.te:
        return [Term(name, _own_norm_bytes(o, width), "seq", None, TE_SOURCE),
                Term(out, width * o.stored(), "seq", None if fused or o.fp8 else "layernorm", TE_SOURCE, grad)]
    return [Term(name, _own_norm_bytes(o, width), "seq", "layernorm"),
            Term(out, width * o.act_bytes, "seq", grad_out=grad)]


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
    d = s.kv_channels or s.hidden // n
    groups = s.query_groups or n
    qk = s.qk_head_dim + s.qk_pos_dim
    first = ((s.q_lora_rank or n * qk) + s.kv_lora_rank + s.qk_pos_dim) if s.mla else (n + 2 * groups) * d
    terms = _block_norm(o, s.hidden, "input norm", not s.mla, first)
    if s.mla:
        q_lora = s.q_lora_rank or 0
        if o.te and o.fp8:  # the q and kv down-projections each keep an FP8 copy of the norm output
            terms.append(Term("second FP8 copy of the input norm output", s.hidden, "seq", None, TE_SOURCE, 0.0))
        if q_lora:
            terms += _norm(o, q_lora, "q latent norm") + [
                Term("q up-projection input", q_lora * o.stored(), "seq", grad_out=n * qk * a)]
        terms += _norm(o, s.kv_lora_rank, "kv latent norm")
        terms.append(Term("kv up-projection input", s.kv_lora_rank * o.stored(), "seq",
                          grad_out=n * (s.qk_head_dim + s.v_head_dim) * a))
        terms += _rope(s, o, s.qk_pos_dim)
        terms.append(Term("q, k, v (attention core inputs)", n * (2 * qk + s.v_head_dim) * a, "tp", "mla_up_proj",
                          TE_SOURCE if o.te else LOCAL_SOURCE))
        heads_out = n * s.v_head_dim
    else:
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
                      TE_SOURCE if o.te else LOCAL_SOURCE, s.hidden * a))
    return terms


def _swiglu(o: Options, width: int, hidden: int, copies: float, name: str, module: str | None,
            down_module: str | None = None) -> list[Term]:
    """A gated MLP's activation and its down-projection's input, for ``copies`` rows per token.
    Megatron's fused SwiGLU keeps only its input (the fc1 output, 2 x width, in the activation
    dtype even under FP8: 0.19's training flags cannot ask for its FP8 store); unfused, the fc1
    output, silu and product tensors (4 x width, measured). ``down_module`` drops the
    down-projection's input alone (moe_act)."""
    act = (2 if o.fused_swiglu else 4) * width * o.act_bytes
    return [Term(f"{name} activation", copies * act, "tp", module, TE_SOURCE if o.te else LOCAL_SOURCE),
            Term(f"{name} down-projection input", copies * width * o.stored(), "tp", down_module or module,
                 TE_SOURCE if o.te else LOCAL_SOURCE, copies * hidden * o.act_bytes)]


def mlp(s: ModelShape, o: Options, moe: bool) -> list[Term]:
    """Pre-MLP norm, then the dense MLP or the MoE layer (router, dispatch, experts, shared experts)."""
    # Transformer Engine fuses the pre-MLP norm into a dense MLP's first linear, not into MoE.
    fc1 = (2 if s.gated else 1) * s.dense_ffn if not moe else 2 * s.shared_ffn
    terms = _block_norm(o, s.hidden, "pre-MLP norm", not moe, fc1)
    if not moe:
        if s.gated:
            return terms + _swiglu(o, s.dense_ffn, s.hidden, 1, "MLP", "mlp")
        return terms + [Term("MLP activation (its input)", s.dense_ffn * o.act_bytes, "tp", "mlp"),
                        Term("MLP down-projection input", s.dense_ffn * o.stored(), "tp", "mlp",
                             grad_out=s.hidden * o.act_bytes)]
    k, fe = s.topk, s.expert_ffn
    maps = ((2 * s.experts + 1) * 4 if o.permute_fusion else 2 * k * INT64) if o.te else 5 * k * INT64
    terms += [Term("router logits, scores, top-k", s.experts * FP32 + k * (INT64 + FP32) + FP32, "seq", "moe"),
              Term("token permutation maps", maps, "seq", "moe", TE_SOURCE if o.te else LOCAL_SOURCE),
              Term("dispatched tokens (experts' input)", k * s.hidden * o.stored(), "seq", "moe",
                   TE_SOURCE if o.te else LOCAL_SOURCE, k * 2 * fe * o.act_bytes),
              Term("routing probabilities", k * FP32, "seq", "moe")]
    terms += _swiglu(o, fe, s.hidden, k, "expert", "moe", "moe_act")
    if s.shared_ffn:
        terms += _swiglu(o, s.shared_ffn, s.hidden, 1, "shared expert", "shared_experts")
    # Recomputing the whole MoE layer drops the shared experts and the experts' activations too.
    return [replace(t, module="moe") if t.module in ("shared_experts", "moe_act") and "moe" in o.modules else t
            for t in terms]


def head(s: ModelShape, o: Options) -> list[Term]:
    """Final norm, output layer input and the loss's fp32 logits (each output head)."""
    return _norm(o, s.hidden, "final norm") + [
        Term("output layer input", s.hidden * o.stored(), "seq", None, TE_SOURCE if o.te else LOCAL_SOURCE,
             s.vocab * o.act_bytes),
        Term("logits (cross entropy)", s.vocab * (o.act_bytes if o.te_cross_entropy else FP32), "tp")]


def mtp_body(s: ModelShape, o: Options, moe: bool) -> list[Term]:
    """One MTP module before its output head: norms of the hidden state and of the shifted
    embedding, the projection of both and a transformer layer like the model's last."""
    return (_norm(o, s.hidden, "MTP hidden norm") + _norm(o, s.hidden, "MTP embedding norm")
            + [Term("MTP projection input", 2 * s.hidden * o.stored(), "seq", grad_out=s.hidden * o.act_bytes)]
            + attention(s, o) + mlp(s, o, moe))


def mtp(s: ModelShape, o: Options, moe: bool) -> list[Term]:
    """One MTP module with its own output head."""
    return mtp_body(s, o, moe) + head(s, o)


def kept(terms: Iterable[Term], o: Options, weight_inputs: bool = False) -> float:
    """Bytes per token the terms keep on one rank: recomputed ones dropped, parallelism applied.
    With ``weight_inputs``, what a backward that left its weight gradients for later (B then W)
    holds until W: every linear's input and output gradient, recomputed inputs rebuilt."""
    total = 0.0
    for t in terms:
        if weight_inputs and t.grad_out is None:
            continue
        if not weight_inputs and t.module is not None and t.module in o.modules:
            continue
        share = o.tp if t.split == "tp" or (t.split == "seq" and o.sp) else 1
        total += (t.per_token + (t.grad_out or 0.0) * weight_inputs) / share
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
    """A model chunk's saved bytes per micro-batch; what its backward rebuilds at once under full
    recompute (one group of layers, alive only while that backward runs, over what it has freed
    by then); and what its deferred weight gradients hold."""

    kept: float
    rebuilt: float
    held: float = 0.0  # from a B that left its weight gradients until their W (:func:`kept`)
    held_last: float = 0.0  # of those, the part of the group a recomputing backward rebuilds last
    step: float = 0.0  # what its forward keeps layer by layer beside an overlapped backward: one layer


def decoder_bytes(s: ModelShape, o: Options, moe_layers: list[bool]) -> ChunkBytes:
    """The decoder layers of one chunk (their MoE pattern), under ``o``'s full recompute if any:
    ``uniform`` N checkpoints groups of N layers, ``block`` N the chunk's first N layers; and what
    their deferred weight gradients hold."""
    per = [layer_bytes(s, o, m) for m in moe_layers]
    held = sum(layer_bytes(s, o, m, weight_inputs=True) for m in moe_layers)
    if o.full is None or not per:
        # Selective recompute rebuilds one layer's recomputed modules at a time.
        whole = replace(o, modules=frozenset())
        rebuilt = max((layer_bytes(s, whole, m) - b for m, b in zip(moe_layers, per)), default=0.0)
        return ChunkBytes(sum(per), rebuilt, held, 0.0, max(per, default=0.0))
    method, n = o.full
    inputs = layer_input_bytes(s, o)
    if method == "uniform":
        groups = [per[i:i + n] for i in range(0, len(per), n)]
        return ChunkBytes(len(groups) * inputs, max(sum(g) for g in groups), held, held * len(groups[0]) / len(per),
                          inputs)
    # The chunk's first n layers: their backward runs last, after the rest have freed theirs.
    recomputed, rest = per[:n], per[n:]
    return ChunkBytes(len(recomputed) * inputs + sum(rest), max(0.0, max(recomputed, default=0.0) - sum(rest)),
                      held, held * len(recomputed) / len(per), max(rest, default=inputs))


def embedding_bytes(s: ModelShape, o: Options) -> float:
    """The embedding's saved token ids (int64)."""
    return INT64 * tokens(s, o)


def head_bytes(s: ModelShape, o: Options, weight_inputs: bool = False) -> float:
    return kept(head(s, o), o, weight_inputs) * tokens(s, o)


def mtp_bytes(s: ModelShape, o: Options, moe: bool, weight_inputs: bool = False) -> float:
    """One MTP module's saved bytes; under full recompute Megatron checkpoints its body, keeping
    the hidden state and the embedding it starts from (:func:`mtp_rebuilt` while rebuilt)."""
    if o.full is not None and not weight_inputs:
        return (2 * layer_input_bytes(s, o)) + head_bytes(s, o)
    return kept(mtp(s, o, moe), o, weight_inputs) * tokens(s, o)


def mtp_rebuilt(s: ModelShape, o: Options, moe: bool) -> float:
    """What a backward rebuilds of one MTP module at once under full recompute (its body)."""
    return kept(mtp_body(s, o, moe), o) * tokens(s, o) if o.full is not None else 0.0


__all__ = ["ChunkBytes", "IMPLS", "Options", "SELECTIVE_MODULES", "Term", "attention", "decoder_bytes",
           "embedding_bytes", "head", "head_bytes", "kept", "layer_bytes", "layer_input_bytes", "mlp", "mtp",
           "mtp_body", "mtp_bytes", "mtp_rebuilt", "tokens"]
