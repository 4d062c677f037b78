#!/usr/bin/env bash
# `make setup-te`: the optional Transformer Engine tier's venv, .venv-te, layered over .venv (a .pth
# line adds .venv's site-packages, so torch, megatron-core and this package come from there and TE
# stays out of the main suite's processes). Installs requirements-te.txt, then builds TE's torch
# binding from its sdist through pip, so pip's wheel cache makes every later setup take seconds.
# Idempotent. TE_VENV overrides the venv's path; MAX_JOBS the build's compile jobs (default: all
# cores). The first build takes about 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV=$PWD/.venv
TE_VENV=${TE_VENV:-.venv-te}
TE_TORCH=transformer-engine-torch==2.20.2  # sdist only; the same version as transformer-engine in requirements-te.txt
SETUP=setup-te
start=$SECONDS
source scripts/layered_venv.sh

[ -x "$MAIN_VENV/bin/python" ] || fail "$MAIN_VENV does not exist: run make setup first"
layer_venv "$TE_VENV" "$MAIN_VENV" main_venv
main_site=$BASE_SITE te_site=$VENV_SITE
# No pip in .venv-te: .venv's pip runs there and installs into .venv-te.
pip=("$TE_VENV/bin/python" -m pip install -q --no-deps)

"${pip[@]}" -r requirements-te.txt || fail "pip could not install requirements-te.txt into $TE_VENV"

# Headers for the build: the CUDA runtime, cuDNN and NCCL ones come with torch's wheels in .venv,
# CCCL and crt with requirements-te.txt in .venv-te. TE's build looks in one nvidia/ folder only.
cpath=
for root in "$te_site/nvidia" "$main_site/nvidia"; do
  for dir in cu13/include cu13/include/cccl cudnn/include nccl/include; do
    [ -d "$root/$dir" ] && cpath=${cpath:+$cpath:}$root/$dir
  done
done
CPATH=$cpath NVTE_FRAMEWORK=pytorch NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_PYTORCH_FORCE_BUILD=TRUE \
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "${pip[@]}" --no-build-isolation "$TE_TORCH" \
  || fail "could not build or install $TE_TORCH: see pip's build output above"

source scripts/te_env.sh
"$TE_VENV/bin/python" -c 'import transformer_engine.pytorch' \
  || fail "$TE_VENV has Transformer Engine installed, but 'import transformer_engine.pytorch' fails (above)"
echo "setup-te: $TE_VENV ready in $((SECONDS - start)) s"
