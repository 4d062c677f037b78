"""A tiny GPT trained by Megatron-Bridge's own ``pretrain()``, on CPU or GPU, under any schedule.

    SCHEDULE=dualpipev python scripts/pretrain_bridge_gpt.py

starts its own processes (torchrun's launcher) and logs Bridge's ``iteration N/ M | ... | lm loss:``
lines. Environment:

- ``SCHEDULE``: ``1f1b`` (Bridge's own schedule), ``dualpipev`` or ``dualpipe`` (default 1f1b);
- ``MOE``: ``1`` for a tiny bf16 MoE (4 experts, top-2, alltoall) at expert parallel 2 (4 processes),
  ``0`` for dense (2 processes; default 0);
- ``MOE_OVERLAP``: ``0`` runs the MoE's F&B ops F then B (in fp32) instead of overlapped through
  Megatron's schedule plans (in bf16, which Megatron asks for; default 1);
- ``PP``: pipeline size (default 2; ``1`` with ``SAVE`` writes a start point);
- ``ITERS``: training iterations (default 6);
- ``EVAL``: evaluate on 2 validation batches every that many iterations (default 0: never);
- ``TRACE``: record our schedule's executed ops there (``python -m dualpipe_megatron.trace``);
- ``DUALPIPE_MOCK_DOCUMENTS``: keep that many documents of Megatron's mock corpus (faster start);
- ``SAVE``: save a checkpoint there at the last iteration; ``LOAD``: start from that checkpoint's
  weights (Bridge's ``pretrained_checkpoint``), so runs of different layouts start alike.

With ``SAVE`` and ``PP=1`` the learning rate is 0: the start point is the initialised model.
The model uses Megatron's local layer spec (TE's needs a GPU); on CPU it runs under our
CPU layer (``dualpipe_megatron.bridge.compat``). Needs megatron-bridge and its import
requirements (``make setup-te``; docs/training.md, "Megatron-Bridge").
"""

from __future__ import annotations

import functools
import os
import sys

SCHEDULE = os.environ.get("SCHEDULE", "1f1b")
MOE = os.environ.get("MOE", "0") == "1"
PP = int(os.environ.get("PP", "2"))
ITERS = int(os.environ.get("ITERS", "6"))
EVAL = int(os.environ.get("EVAL", "0"))
SAVE, LOAD = os.environ.get("SAVE"), os.environ.get("LOAD")
OVERLAP = MOE and os.environ.get("MOE_OVERLAP", "1") == "1"
EP = 2 if MOE else 1
WORLD = PP * EP  # data parallel = expert parallel for the MoE case
GLOBAL_BATCH = 8


def _config():
    import torch
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training.config import (
        CheckpointConfig, ConfigContainer, DistributedDataParallelConfig, DistributedInitConfig, LoggerConfig,
        MockGPTDatasetConfig, OptimizerConfig, RNGConfig, SchedulerConfig, TokenizerConfig, TrainingConfig,
        ValidationConfig,
    )
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    moe = dict(num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=EP, moe_ffn_hidden_size=64,
               moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
               moe_aux_loss_coeff=1e-2, moe_grouped_gemm=False) if MOE else {}
    dtype = torch.bfloat16 if OVERLAP else torch.float32  # Megatron's MoE overlap asks for bf16 or fp16
    model = GPTModelProvider(
        num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=32, vocab_size=128,
        transformer_layer_spec=functools.partial(get_gpt_decoder_block_spec, use_transformer_engine=False),
        pipeline_model_parallel_size=PP, use_cpu_initialization=True, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, hidden_dropout=0.0, attention_dropout=0.0,
        share_embeddings_and_output_weights=False, pipeline_dtype=dtype, params_dtype=dtype, bf16=OVERLAP, fp16=False,
        **moe)
    lr = 0.0 if SAVE and PP == 1 else 1e-3
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=ITERS, global_batch_size=GLOBAL_BATCH, micro_batch_size=1),
        validation=ValidationConfig(eval_interval=EVAL or None, eval_iters=2 if EVAL else 0),
        optimizer=OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, use_distributed_optimizer=False, bf16=OVERLAP,
                                  fp16=False, params_dtype=dtype, clip_grad=1.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.01,
                                  end_weight_decay=0.01, weight_decay_incr_style="constant"),
        dataset=MockGPTDatasetConfig(seq_length=32, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     split="1,1,1", dataloader_type="single", num_workers=0),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=128),
        checkpoint=CheckpointConfig(save=SAVE, save_interval=ITERS if SAVE else None, pretrained_checkpoint=LOAD,
                                    ckpt_format="torch_dist"),
        dist=DistributedInitConfig(distributed_backend="gloo" if not torch.cuda.is_available() else "nccl"),
        # Gradients accumulate in fp32 (as Bridge's recipes set it): bf16 buffers would round each sum.
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False, grad_reduce_in_fp32=True),
        rng=RNGConfig(seed=1234),
    )


def train() -> None:
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    import dualpipe_megatron.bridge as dualpipe_bridge
    from dualpipe_megatron.bridge.compat import install_bridge_compat
    from dualpipe_megatron.routes import limit_mock_corpus

    install_bridge_compat()
    limit_mock_corpus()
    cfg = _config()
    if SCHEDULE != "1f1b":
        # MoE: each F&B op overlaps one micro-batch's all-to-alls with the other's compute through
        # Megatron's schedule plans, which Bridge's forward step builds only with this set.
        cfg.model.overlap_moe_expert_parallel_comm = OVERLAP
        dualpipe_bridge.enable(cfg, SCHEDULE, moe_overlap=OVERLAP, trace_dir=os.environ.get("TRACE"))
    pretrain(cfg, forward_step)


def main() -> None:
    if "RANK" in os.environ:
        train()
        return
    from torch.distributed.run import main as torchrun

    torchrun([f"--nproc-per-node={WORLD}", "--master-port", os.environ.get("MASTER_PORT", "29541"), __file__])


if __name__ == "__main__":
    sys.exit(main())
