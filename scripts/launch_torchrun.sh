#!/usr/bin/env bash
# Launch scripts/pretrain_gpt.py with DualPipeV on GPUs through torchrun, one call per node.
#
# A TEMPLATE with DeepSeek-V3's settings (61 layers, MLA, 256 routed experts top-8 plus a
# shared expert, FP8 blockwise, PP=16 dualpipev x EP=64 on 256 nodes of 8 GPUs). It has not been
# run here: this project is verified on CPU only, and the DualPipe runtime on NCCL, Transformer
# Engine, FP8 and the flex/DeepEP dispatcher are untested with our schedule (see docs/compatibility.md's
# status by feature). Start from a small proxy and check losses against 1F1B first.
#
# Every setting is an environment variable; extra arguments go to pretrain_gpt.py last (and win):
#   NNODES=1 PP=2 EP=4 NUM_LAYERS=16 LAYOUT= HIDDEN=2048 FFN_HIDDEN=8192 HEADS=16 NUM_EXPERTS=64 \
#       GBS=64 scripts/launch_torchrun.sh --train-iters 100    # a one-node, 8-GPU proxy
#   DRY_RUN=1 scripts/launch_torchrun.sh      # print the command and check its plan, run nothing
#   scripts/launch_torchrun.sh --dry-run ...  # the same (PLAN=0: the command only)
#   SCHEDULE=dualpipe scripts/launch_torchrun.sh --dry-run  # DualPipe (its own default layout)
#   COMPARE=1 GPU_MEMORY=80 scripts/launch_torchrun.sh --dry-run  # every schedule for this job, side by side
# Multi-node: run it once per node with NODE_RANK and MASTER_ADDR set (launch_slurm.sbatch does).
set -euo pipefail

if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
DRY_RUN=${DRY_RUN:-0}
REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

# -- cluster ------------------------------------------------------------------------------------
NNODES=${NNODES:-${SLURM_NNODES:-256}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-29500}
TORCHRUN=${TORCHRUN:-torchrun}

# -- parallelism (DeepSeek-V3: PP=16, EP=64, TP=1, ZeRO-1 data parallel) --------------------------
SCHEDULE=${SCHEDULE:-dualpipev}  # dualpipev: P ranks, 2P stages; dualpipe holds every stage twice
PP=${PP:-16}
TP=${TP:-1}
EP=${EP:-64}
MBS=${MBS:-1}
GBS=${GBS:-15360}                # micro-batches per step = GBS / (MBS x DP); must be >= 2 x PP
# Layers per stage in stage order, what --dualpipe-layout auto picks for DeepSeek-V3 at P=16:
# dualpipev (2 x PP stages): embedding + 1 layer first, 30 stages of 2 layers, the MTP layer and
# the loss alone last (it shares rank 0 with the embedding); dualpipe (PP stages per direction):
# embedding + 4 layers, 14 stages of 4, then 1 layer with the MTP layer and the loss.
# Empty: even split; auto: the layout search at start-up.
NUM_LAYERS=${NUM_LAYERS:-61}
case "$SCHEDULE" in
    dualpipev) LAYOUT=${LAYOUT-"Et|(tt|)*30mL"} ;;
    dualpipe) LAYOUT=${LAYOUT-"Etttt|(tttt|)*14tmL"} ;;
    *) LAYOUT=${LAYOUT-} ;;
esac
TRACE_DIR=${TRACE_DIR:-}         # set to record every pipeline op (python -m dualpipe_megatron.trace)

WORLD=$((NNODES * GPUS_PER_NODE))
if (( WORLD % (PP * TP) )); then
    echo "error: $WORLD GPUs do not divide into PP=$PP x TP=$TP" >&2; exit 2
fi
DP=$((WORLD / (PP * TP)))
if (( (WORLD / PP) % EP )); then  # experts fold over the TP x DP ranks of a stage (expert TP = 1)
    echo "error: the $((WORLD / PP)) GPUs of a pipeline stage do not divide into EP=$EP" >&2; exit 2
fi
if (( GBS % (MBS * DP) )); then echo "error: GBS=$GBS is not a multiple of MBS x DP = $((MBS * DP))" >&2; exit 2; fi
MICROBATCHES=$((GBS / (MBS * DP)))
if (( MICROBATCHES < 2 * PP )); then
    echo "error: $MICROBATCHES micro-batches per step; $SCHEDULE needs >= 2 x PP = $((2 * PP)) (raise GBS)" >&2; exit 2
fi

# -- environment ---------------------------------------------------------------------------------
# Megatron needs one CUDA connection so communication kernels are queued in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# Site-specific (uncomment and fill in for your fabric):
# export NCCL_SOCKET_IFNAME=eth0 NCCL_IB_HCA=mlx5 NCCL_IB_GID_INDEX=3
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# -- model: DeepSeek-V3-like -----------------------------------------------------------------------
SEQ_LENGTH=${SEQ_LENGTH:-4096}
MODEL=(
    --num-layers "$NUM_LAYERS" --hidden-size "${HIDDEN:-7168}" --ffn-hidden-size "${FFN_HIDDEN:-18432}"
    --num-attention-heads "${HEADS:-128}" --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
    --position-embedding-type rope --rotary-base 10000 --rotary-scaling-factor 40
    --mscale 1.0 --mscale-all-dim 1.0
    # Multi-latent attention
    --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128
    --qk-pos-emb-head-dim 64 --v-head-dim 128 --kv-channels 128 --qk-layernorm
    # MoE: dense first 3 layers, then 256 routed experts (top-8, node-limited groups) + 1 shared
    --num-experts "${NUM_EXPERTS:-256}" --moe-layer-freq "([0]*3+[1]*$((NUM_LAYERS - 3)))" --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-router-num-groups 8
    --moe-router-group-topk 4 --moe-router-score-function sigmoid --moe-router-topk-scaling-factor 2.5
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm --moe-permute-fusion
    --moe-token-dispatcher-type "${DISPATCHER:-alltoall}"  # flex + --moe-flex-dispatcher-backend deepep: untested
    --mtp-num-layers 1  # DeepSeek-V3: one MTP module, at the loss stage
)
PARALLEL=(
    --pipeline-model-parallel-size "$PP" --pipeline-schedule "$SCHEDULE"
    --tensor-model-parallel-size "$TP" --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
    --dualpipe-p2p-timeout "${P2P_TIMEOUT:-600}"
)
[[ -n "$LAYOUT" ]] && PARALLEL+=(--dualpipe-layout "$LAYOUT")
(( TP > 1 )) && PARALLEL+=(--sequence-parallel)
[[ -n "$TRACE_DIR" ]] && PARALLEL+=(--dualpipe-trace "$TRACE_DIR")
# DeepSeek-V3's recompute (tech report 3.2.3): RMSNorm and the MLA up-projections, recomputed in
# the backward instead of kept. RECOMPUTE="" keeps everything; any of Megatron's
# --recompute-modules (core_attn mla_up_proj layernorm mlp moe moe_act shared_experts) may be listed.
RECOMPUTE=${RECOMPUTE-layernorm mla_up_proj}
# shellcheck disable=SC2206  # a list of module names
[[ -n "$RECOMPUTE" ]] && PARALLEL+=(--recompute-granularity selective --recompute-modules $RECOMPUTE)
PRECISION=(--bf16)
if [[ "${FP8:-1}" == 1 ]]; then  # DeepSeek-V3 style 1x128 / 128x128 block scaling; needs TE >= 2.x on Hopper+
    PRECISION+=(--fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather --moe-router-padding-for-fp8)
fi
if [[ -n "${DATA_PATH:-}" ]]; then  # unquoted on purpose: "0.7 /data/a 0.3 /data/b" blends
    DATA=(--data-path $DATA_PATH --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
          --tokenizer-model "${TOKENIZER_MODEL:-deepseek-ai/DeepSeek-V3}")
else
    DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 129280)
fi
TRAINING=(
    --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "${TRAIN_ITERS:-500000}"
    --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006
    --attention-backend auto --cross-entropy-loss-fusion --manual-gc
    --log-interval 10 --eval-interval 1000 --eval-iters 10 --distributed-timeout-minutes 60
)
[[ -n "${CKPT_DIR:-}" ]] && TRAINING+=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 1000 --ckpt-format torch_dist)

PRETRAIN_ARGS=("${MODEL[@]}" "${PARALLEL[@]}" "${PRECISION[@]}" "${DATA[@]}" "${TRAINING[@]}" "$@")
CMD=("$TORCHRUN" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     "$REPO/scripts/pretrain_gpt.py" "${PRETRAIN_ARGS[@]}")

if [[ "$DRY_RUN" == 1 ]]; then
    echo "# dry run: $WORLD GPUs = PP $PP x TP $TP x DP $DP (EP $EP), $MICROBATCHES micro-batches per step"
    for var in CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_AVOID_RECORD_STREAMS TORCH_NCCL_ASYNC_ERROR_HANDLING \
               PYTORCH_CUDA_ALLOC_CONF NCCL_DEBUG NCCL_IB_TIMEOUT NCCL_NVLS_ENABLE PYTHONPATH; do
        printf 'export %s=%q\n' "$var" "${!var}"
    done
    echo "# command"
    printf '%q ' "${CMD[@]}"; echo
    # The plan: every start-up check, the layout, memory per rank, the projected step (no model
    # is built). Run it where the training environment is (FP8 needs Transformer Engine); PLAN=0
    # skips it. A refusal fails the dry run with the check's message.
    # COMPARE=1: every schedule that can run this job instead, marked against GPU_MEMORY GiB (80).
    if [[ "${PLAN:-1}" == 1 ]]; then
        COMPARE_ARGS=()
        [[ "${COMPARE:-0}" == 1 ]] && COMPARE_ARGS=(--compare --gpu-memory "${GPU_MEMORY:-80}")
        "${PYTHON:-python}" -m dualpipe_megatron.plan --world-size "$WORLD" \
            --gpus-per-node "$GPUS_PER_NODE" "${COMPARE_ARGS[@]}" -- "${PRETRAIN_ARGS[@]}"
    fi
    exit 0
fi
exec "${CMD[@]}"
