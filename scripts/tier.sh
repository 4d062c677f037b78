#!/usr/bin/env bash
# An optional tier of the suite, run apart in its own venv with Transformer Engine's library paths:
#   bash scripts/tier.sh te      tests/te in .venv-te (make setup-te), run by `make test`
#   bash scripts/tier.sh bridge  tests/bridge in .venv-bridge (make setup-bridge), `make test-bridge`
# When the venv is missing or cannot import what the tier is about, one line says why, and it
# succeeds. TE_VENV/BRIDGE_VENV override the venvs' paths; further arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV=$PWD/.venv
tier=${1:?usage: tier.sh te|bridge [pytest arguments]}
shift
case $tier in
  te) venv=${TE_VENV:-.venv-te} premise=transformer_engine.pytorch setup=setup-te ;;
  bridge) venv=${BRIDGE_VENV:-.venv-bridge} premise=megatron.bridge.training.pretrain setup=setup-bridge ;;
  *) echo "unknown tier $tier (te or bridge)" >&2; exit 2 ;;
esac

skip() {
  echo "$tier tier skipped: $1 (make $setup builds it)"
  exit 0
}

[ -x "$venv/bin/python" ] || skip "no $venv"
[ -x "$MAIN_VENV/bin/python" ] || skip "no $MAIN_VENV"
source scripts/te_env.sh
why=$("$venv/bin/python" -W ignore -c "import $premise" 2>&1) \
  || skip "$venv cannot import $premise ($(tail -n 1 <<<"$why"))"
exec "$venv/bin/python" -m pytest -q --disable-warnings "tests/$tier" "$@"
