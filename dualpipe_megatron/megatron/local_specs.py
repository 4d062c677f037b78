"""A HybridModel stack spec of Megatron-Core's local (non-Transformer-Engine) modules.

Megatron-Core 0.19 ships ``hybrid_stack_spec`` for Transformer Engine only, and its
``HybridStack`` builds the final norm as a TE norm whatever the spec says. This spec
builds the same layer kinds from Megatron's local modules, so a HybridModel trains on
CPU (and anywhere TE is absent); pass it as

    --spec dualpipe_megatron.megatron.local_specs hybrid_stack_spec

It covers attention (``*``), multi-latent attention (``+``), dense MLP (``-``), MoE (``E``)
and MTP (``/...``), with the layer norms a local GPT layer has (``input_layernorm`` before
attention, ``pre_mlp_layernorm`` before an MLP or MoE), so a GPT checkpoint translates onto it
(``megatron.core.dist_checkpointing.gpt_checkpoint_interop``). Mamba (``M``), gated delta net
(``G``) and DeepSeek sparse attention (``D``) need CUDA kernels and TE: they are refused when
built, naming the kind. On a GPU keep Megatron's TE spec.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock, MultiTokenPredictionBlockSubmodules, MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer, TransformerLayer, TransformerLayerSubmodules,
)

# LayerNorm or RMSNorm as the config says (torch's own; apex's fused norm has no RMSNorm).
NORM = WrappedTorchNorm
CUDA_ONLY = {"M": "Mamba", "G": "gated delta net (GDN)", "D": "DeepSeek sparse attention (DSA)"}


class LocalHybridStack(HybridStack):
    """``HybridStack`` with a local final norm (Megatron's builds a TE norm unconditionally)."""

    def __init__(self, config: Any, submodules: HybridStackSubmodules, *args: Any,
                 post_layer_norm: bool = True, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = NORM(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


class LocalAttentionLayer(TransformerLayer):
    """An attention layer whose q/k norms follow ``--qk-layernorm``. Left out of a spec, Megatron's
    attention takes TE's norm (standard) or a TE norm-fused linear (MLA), and named in a spec while
    the flag is off it refuses them; so the norms are named here, per layer, when the config asks
    (also inside MTP, whose stack is Megatron's own)."""

    def __init__(self, config: Any, submodules: TransformerLayerSubmodules, *args: Any, **kwargs: Any) -> None:
        if config.qk_layernorm:
            submodules = copy.deepcopy(submodules)  # the spec is shared by every layer
            attention = submodules.self_attention.submodules
            if isinstance(attention, MLASelfAttentionSubmodules):
                norms = ["kv_layernorm"] + (["q_layernorm"] if config.q_lora_rank is not None else [])
            else:
                norms = ["q_layernorm", "k_layernorm"]
            for name in norms:
                setattr(attention, name, NORM)
        super().__init__(config, submodules, *args, **kwargs)


def _refusal(symbol: str) -> type:
    """A layer class that refuses to be built: layer kind ``symbol`` needs CUDA kernels."""
    def __init__(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"hybrid layer '{symbol}' ({CUDA_ONLY[symbol]}) needs CUDA kernels and Transformer Engine; "
            f"the local hybrid spec (dualpipe_megatron.megatron.local_specs) builds '*', '+', '-' "
            f"and 'E' layers only: on a GPU use --spec megatron.core.models.hybrid.hybrid_layer_specs "
            f"hybrid_stack_spec")
    return type(f"Unsupported{CUDA_ONLY[symbol].split()[0].title()}Layer", (), {"__init__": __init__})


# Checkpoint keys: where Megatron's TE hybrid spec fuses a norm into the next linear, the local
# norm saves under the fused key (as a local GPT layer does), so checkpoints move between this
# spec, the TE one and GPTModel's (load-time translation).
FUSED_INPUT_NORM = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
FUSED_MLP_NORM = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _attention_layer(self_attention: ModuleSpec, keys: dict[str, str]) -> ModuleSpec:
    return ModuleSpec(module=LocalAttentionLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=NORM, self_attention=self_attention, self_attn_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=keys))


def _mlp_layer(module: type, mlp: Any, keys: dict[str, str]) -> ModuleSpec:
    return ModuleSpec(module=module, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=NORM, mlp=mlp, mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys))


hybrid_stack_spec = ModuleSpec(
    module=LocalHybridStack,
    submodules=HybridStackSubmodules(
        mamba_layer=_refusal("M"),
        gdn_layer=_refusal("G"),
        dsa_layer=_refusal("D"),
        attention_layer=_attention_layer(ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=DotProductAttention,
                                               linear_proj=RowParallelLinear)), FUSED_INPUT_NORM),
        mla_layer=_attention_layer(ModuleSpec(
            module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
                linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
                linear_kv_up_proj=ColumnParallelLinear, core_attention=DotProductAttention,
                linear_proj=RowParallelLinear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp)), {}),
        # A local GPT layer's MLP and MoE (num_experts only selects the MoE spec; the layer reads
        # --num-experts from the config).
        mlp_layer=_mlp_layer(MLPLayer, get_mlp_module_spec_for_backend(LocalSpecProvider()), FUSED_MLP_NORM),
        # TE's MoE layer keeps a separate norm (a local GPT MoE layer saves it under the fused key).
        moe_layer=_mlp_layer(MoETransformerLayer, get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=1),
                             {}),
        mtp_block_spec=ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
                enorm=NORM, hnorm=NORM, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=NORM))])),
    ),
)

__all__ = ["CUDA_ONLY", "LocalAttentionLayer", "LocalHybridStack", "hybrid_stack_spec"]
