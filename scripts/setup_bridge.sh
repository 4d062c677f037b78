#!/usr/bin/env bash
# `make setup-bridge`: the optional Megatron-Bridge tier's venv, .venv-bridge, layered over .venv-te
# (a .pth line adds its site-packages, and through its own .pth .venv's), with requirements-bridge.txt
# and scripts/nvrx_stand_in (see its docstring). Needs `make setup-te` first. Idempotent; about a
# minute from pip's cache. BRIDGE_VENV and TE_VENV override the venvs' paths.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV=$PWD/.venv
TE_VENV=${TE_VENV:-.venv-te}
BRIDGE_VENV=${BRIDGE_VENV:-.venv-bridge}
SETUP=setup-bridge
start=$SECONDS
source scripts/layered_venv.sh

[ -x "$TE_VENV/bin/python" ] || fail "$TE_VENV does not exist: run make setup-te first"
layer_venv "$BRIDGE_VENV" "$TE_VENV" te_venv
echo "$PWD/scripts/nvrx_stand_in" >"$VENV_SITE/nvrx_stand_in.pth"
"$MAIN_VENV/bin/python" -m pip --python "$BRIDGE_VENV/bin/python" install -q --no-deps -r requirements-bridge.txt \
  || fail "pip could not install requirements-bridge.txt into $BRIDGE_VENV"

source scripts/te_env.sh
"$BRIDGE_VENV/bin/python" -W ignore -c 'from megatron.bridge.training.pretrain import pretrain' \
  || fail "$BRIDGE_VENV has megatron-bridge installed, but importing its pretrain() fails (above)"
echo "setup-bridge: $BRIDGE_VENV ready in $((SECONDS - start)) s"
