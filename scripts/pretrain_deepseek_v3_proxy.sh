#!/usr/bin/env bash
# The DeepSeek-V3 proxy: DeepSeek-V3's structure at tiny sizes (scripts/deepseek_v3_proxy.flags:
# MLA, dense then MoE layers, a shared expert, sigmoid routing with expert bias, group-limited
# routing, MTP, EPLB), trained by scripts/pretrain_gpt.py on 4 processes (EP=2 x P=2). Without a
# GPU it runs on CPU with gloo and mock data. The starting point for a DeepSeek-style job: check
# its losses under your schedule against 1F1B, then scale the sizes up.
#
#   scripts/pretrain_deepseek_v3_proxy.sh                       # dualpipev, 8 iterations, CPU
#   SCHEDULE=dualpipe scripts/pretrain_deepseek_v3_proxy.sh     # or 1f1b (Megatron's own)
#   DRY_RUN=1 scripts/pretrain_deepseek_v3_proxy.sh             # print the command, run nothing
# Extra arguments go to pretrain_gpt.py last (and win), e.g. --recompute-granularity selective
# --recompute-modules mla_up_proj layernorm.
set -euo pipefail

REPO=${REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
SCHEDULE=${SCHEDULE:-dualpipev}
ITERS=${ITERS:-8}
TORCHRUN=${TORCHRUN:-torchrun}
DRY_RUN=${DRY_RUN:-0}

PROXY=()
while IFS= read -r line || [[ -n "$line" ]]; do
    line=${line%%#*}
    read -ra words <<< "$line"
    PROXY+=("${words[@]}")
done < "$REPO/scripts/deepseek_v3_proxy.flags"

DEVICE=()
if ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    # CPU (docs/megatron_cpu.md): gloo, local layers, no fused kernels; two simulated nodes of
    # one GPU each, so the hierarchical EPLB policy keeps each routing group on its own node.
    DEVICE=(--distributed-backend gloo --transformer-impl local --use-cpu-initialization
            --no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion
            --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm)
fi

ARGS=("${PROXY[@]}" "${DEVICE[@]}"
      --pipeline-schedule "$SCHEDULE"
      --mock-data --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 16
      --train-iters "$ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1
      --seed 1234 --log-interval 1 --eval-interval 1000 --eval-iters 0
      "$@")
CMD=("$TORCHRUN" --nproc-per-node 4 "$REPO/scripts/pretrain_gpt.py" "${ARGS[@]}")
if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${CMD[@]}"; echo
    exit 0
fi
exec "${CMD[@]}"
