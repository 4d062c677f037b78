#!/usr/bin/env bash
# Print the path of a working Python 3.12 interpreter, or explain what to install.
# A pyenv shim on PATH may exist without 3.12 being active, so each candidate is run.
set -u
candidates=(python3.12)
for root in "${PYENV_ROOT:-}" "$HOME/.pyenv"; do
  [ -n "$root" ] && candidates+=("$root"/versions/3.12*/bin/python3.12)
done
candidates+=(/usr/local/bin/python3.12 /usr/bin/python3.12)
for py in "${candidates[@]}"; do
  if out=$("$py" -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null); then
    echo "$out"
    exit 0
  fi
done
echo "error: Python 3.12 not found (megatron-core 0.19 needs it). Install it, e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv', then rerun make." >&2
exit 1
