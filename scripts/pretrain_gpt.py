"""GPT / MoE / HybridModel pretraining on ``megatron.training`` with ``--pipeline-schedule`` available.

Built as Megatron-LM 0.19's own ``pretrain_gpt.py`` is: a config container whose model config
(``gpt_config_from_args``) Megatron's GPT model builder turns into model chunks, so the layer spec
follows Megatron's rules (local or Transformer Engine, dense or MoE, MLA, MTP) and ``--spec``. With
``--hybrid-layer-pattern`` the container holds a HybridModel config instead (``hybrid_config_from_args``,
as Megatron-LM's ``pretrain_hybrid.py`` builds it; on CPU pass ``--spec
dualpipe_megatron.megatron.local_specs hybrid_stack_spec``).
Run directly, it installs our hooks (and, without CUDA, the CPU compatibility layer) through
``routes.install_for_training``, the launcher's own call, and trains. Its functions are also a
stock Megatron script's: imported elsewhere it installs nothing (see tests/stock_pretrain_gpt.py,
run through ``python -m dualpipe_megatron.launch``; tests/legacy_pretrain_gpt.py passes a
``model_provider`` instead, the older route 0.19 still accepts).

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --pipeline-model-parallel-size 4 \\
        --pipeline-schedule dualpipev ... (any Megatron pretraining flags)

Mock data (``--mock-data``) or Megatron's indexed datasets (``--data-path``). Without CUDA it
runs on CPU with gloo (``--distributed-backend gloo``; see docs/megatron_cpu.md for the CPU flags).
"""

from __future__ import annotations

import os
import sys
from functools import partial

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_attr_wrapped_model
from megatron.training import get_args, get_tokenizer, pretrain
from megatron.training.argument_utils import (
    gpt_config_from_args, hybrid_config_from_args, pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _broadcast_batch(batch: dict | None, args) -> dict:
    """TP rank 0 reads; the other tensor-parallel ranks receive the same tensors."""
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return batch
    src = parallel_state.get_tensor_model_parallel_src_rank()
    shape = (args.micro_batch_size, args.seq_length)
    out = {}
    for key in BATCH_KEYS:
        dtype = torch.float if key == "loss_mask" else torch.int64
        t = batch[key].to(dtype) if batch is not None else torch.empty(shape, dtype=dtype)
        torch.distributed.broadcast(t, src, group=group)
        out[key] = t
    return out


def get_batch(data_iterator, vp_stage: int | None) -> dict | None:
    """The micro-batch for a chunk that holds the embedding or the loss; None for middle stages.

    ``parallel_state``'s stage predicates answer for our placement under DualPipe/DualPipeV.
    """
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if not (first or last):
        return None
    args = get_args()
    raw = next(data_iterator) if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    batch = _broadcast_batch(raw, args)
    return {key: batch[key].to(torch.cuda.current_device()) for key in BATCH_KEYS}


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple: summed masked loss, token count, report {'lm loss': [sum, count]}."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """The model output and its loss function; with ``return_schedule_plan`` (Megatron's EP-overlap
    convention, used by our MoE F&B overlap) a schedule plan of the forward instead of the output."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")  # under the DDP/Float16Module wrappers
    batch = get_batch(data_iterator, vp_stage)
    run = model.build_schedule_plan if return_schedule_plan else model
    if batch is None:
        return run(None, None, None), None
    output = run(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                 loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
        blend_per_split=blend_per_split, split=args.split, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, path_to_cache=args.data_cache_path,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples,
                                        lambda: True, config).build()


datasets_provider.is_distributed = True


def main() -> None:
    """A stock Megatron 0.19 pretraining entry: the model comes from a config container (Megatron's
    GPT model builder, or its hybrid one under ``--hybrid-layer-pattern``, no ``model_provider``);
    our flag exists once the hooks are installed."""
    args = parse_and_validate_args()
    model_config = hybrid_config_from_args(args) if args.hybrid_layer_pattern else gpt_config_from_args(args)
    pretrain(pretrain_cfg_container_from_args(args, model_config), datasets_provider,
             ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dualpipe_megatron.routes import install_for_training

    install_for_training()  # what python -m dualpipe_megatron.launch installs, through the same call
    main()
