"""``python -m dualpipe_megatron.launch SCRIPT [ARGS]``: run an unmodified Megatron pretrain
script with ``--pipeline-schedule`` available.

Installs what ``scripts/pretrain_gpt.py`` installs, through the same function
(``routes.install_for_training``): the CPU compatibility layer (a no-op where CUDA exists), the
wheel's built dataset helpers (GPU too) and the training hooks (through Megatron's schedule
extension point where patches/ was applied, else guarded runtime patches). Then it runs SCRIPT
as ``__main__`` with ARGS. Works under torchrun and srun, which start
this command once per rank.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"error: no such script: {script}", file=sys.stderr)
        return 2
    from .routes import install_for_training

    install_for_training()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
