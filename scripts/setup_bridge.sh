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
start=$SECONDS

fail() {
  echo "setup-bridge FAILED: $*" >&2
  exit 1
}

[ -x "$TE_VENV/bin/python" ] || fail "$TE_VENV does not exist: run make setup-te first"
[ -x "$BRIDGE_VENV/bin/python" ] || "$MAIN_VENV/bin/python" -m venv --without-pip "$BRIDGE_VENV" \
  || fail "could not create $BRIDGE_VENV"
te_site=$("$TE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
bridge_site=$("$BRIDGE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo "import site; site.addsitedir('$te_site')" >"$bridge_site/te_venv.pth"
echo "$PWD/scripts/nvrx_stand_in" >"$bridge_site/nvrx_stand_in.pth"
"$MAIN_VENV/bin/python" -m pip --python "$BRIDGE_VENV/bin/python" install -q --no-deps -r requirements-bridge.txt \
  || fail "pip could not install requirements-bridge.txt into $BRIDGE_VENV"

source scripts/te_env.sh
"$BRIDGE_VENV/bin/python" -W ignore -c 'from megatron.bridge.training.pretrain import pretrain' \
  || fail "$BRIDGE_VENV has megatron-bridge installed, but importing its pretrain() fails (above)"
echo "setup-bridge: $BRIDGE_VENV ready in $((SECONDS - start)) s"
