#!/usr/bin/env bash
# Megatron-LM 0.19's own pretrain_gpt.py and pretrain_hybrid.py under --pipeline-schedule dualpipev|dualpipe
# against the same script under Megatron's 1F1B, on CPU (gloo): dense P=2 and P=4, MoE EP=2 x P=2 with the F&B
# overlap, MTP 1, EPLB with redundant experts, a save and resume; HybridModel dense and MoE
# ('*-*-*-*-/*-', '*-*E*E*E/*E' with MTP) on our local hybrid spec, and a GPT checkpoint saved under
# dualpipev resumed as a HybridModel. Every run starts from one PP=1 checkpoint; the lm loss of
# iterations 2-7 must agree to 1e-5 relative.
#
#   scripts/check_megatron_lm.sh MEGATRON_LM_DIR [--out DIR] [--only CASE,...]
#
# MEGATRON_LM_DIR: a Megatron-LM checkout of branch core_r0.19.0 (never committed here); its
# pretrain_gpt.py, pretrain_hybrid.py, gpt_builders.py, hybrid_builders.py and model_provider.py run
# unmodified. About 12 minutes on 2 cores.
# The matrix and the comparisons: scripts/check_megatron_lm.py; docs/compatibility.md.
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
[[ -x "$PY" ]] || PY=python3
exec "$PY" "$REPO/scripts/check_megatron_lm.py" "$@"
