"""scripts/pretrain_gpt.py with its op tracer attached on odd iterations only (bench use).

Adjacent iterations see the same machine load, so comparing each traced
iteration with its untraced neighbours cancels drift that whole-run
comparisons cannot. Run through torchrun exactly like pretrain_gpt.py.
"""

from __future__ import annotations

import itertools
import runpy
import sys
from pathlib import Path

from dualpipe_megatron.megatron import schedule

PRETRAIN = Path(__file__).resolve().parent.parent / "scripts" / "pretrain_gpt.py"
_calls = itertools.count()
_tracer = schedule._tracer


def _every_other(options: schedule.DualPipeOptions, group):  # noqa: ANN001 - torch ProcessGroup
    tracer = _tracer(options, group)
    return tracer if next(_calls) % 2 == 0 else None  # iteration 1, 3, 5, ... traced


schedule._tracer = _every_other
sys.argv[0] = str(PRETRAIN)
runpy.run_path(str(PRETRAIN), run_name="__main__")
