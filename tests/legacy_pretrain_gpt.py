"""A stock-style Megatron script on the legacy route: ``pretrain(..., model_provider=...)``.

Megatron 0.19 still accepts a ``model_provider`` (``training.get_model`` builds the chunks from
it) beside the config container that ``scripts/pretrain_gpt.py`` uses. This script is that
script with the older door: the same data and forward step, a local or Transformer Engine GPT
layer spec chosen as Megatron-LM's ``gpt_builders.py`` chooses it. It never imports
dualpipe_megatron; run it through ``python -m dualpipe_megatron.launch``.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args  # noqa: E402

from pretrain_gpt import datasets_provider, forward_step  # noqa: E402


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config=None, pg_collection=None) -> GPTModel:
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te,
                                          normalization=args.normalization, vp_stage=vp_stage)
    else:
        layer = get_gpt_layer_with_transformer_engine_spec if use_te else get_gpt_layer_local_spec
        spec = layer(qk_layernorm=args.qk_layernorm, multi_latent_attention=args.multi_latent_attention)
    mtp = (get_gpt_mtp_block_spec(config, spec, use_transformer_engine=use_te, vp_stage=vp_stage)
           if args.mtp_num_layers else None)
    return GPTModel(
        config, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        vp_stage=vp_stage, pg_collection=pg_collection, mtp_block_spec=mtp,
    )


if __name__ == "__main__":
    args = parse_and_validate_args()
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider=model_provider)
