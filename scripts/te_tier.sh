#!/usr/bin/env bash
# The Transformer Engine tier (tests/te), which `make test` runs after the main suite: in .venv-te
# with TE's library paths, when .venv-te imports transformer_engine.pytorch; else one line saying
# why, and success. TE_VENV overrides the venv's path; arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV=$PWD/.venv
TE_VENV=${TE_VENV:-.venv-te}

skip() {
  echo "TE tier skipped: $1 (make setup-te builds it)"
  exit 0
}

[ -x "$TE_VENV/bin/python" ] || skip "no $TE_VENV"
[ -x "$MAIN_VENV/bin/python" ] || skip "no $MAIN_VENV"
source scripts/te_env.sh
why=$("$TE_VENV/bin/python" -c 'import transformer_engine.pytorch' 2>&1) \
  || skip "$TE_VENV cannot import transformer_engine.pytorch ($(tail -n 1 <<<"$why"))"
exec "$TE_VENV/bin/python" -m pytest -q --disable-warnings tests/te "$@"
