"""``scripts/pretrain_gpt.py`` with every training step under the activation meter.

Run it as the pretraining script itself (torchrun, or the tests' fork server): it wraps
``megatron.training.training.train_step`` so that the step's forward-backward function runs under
:class:`activation_meter.ActivationMeter` (parameters excluded), then runs the real script as
``__main__``. After each step every rank writes ``{"rank", "pp_rank", "peaks", "cuda_peaks"}``
(bytes, one per step so far; ``cuda_peaks`` on a GPU: ``torch.cuda.max_memory_allocated`` during
the step above what was allocated when it began) to ``$DUALPIPE_METER_DIR/rank<RANK>.json``.
Nothing else about the job changes: the same flags, schedules and checks as the script.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "scripts" / "pretrain_gpt.py"
OUT_ENV = "DUALPIPE_METER_DIR"


def _chunks(model: Any) -> list[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def metered(forward_backward: Callable[..., Any], out: Path, peaks: list[int], cuda_peaks: list[int]
            ) -> Callable[..., Any]:
    """``forward_backward`` measured: each call's peaks are appended and written out."""
    import torch
    from activation_meter import ActivationMeter
    from megatron.core import parallel_state

    def run(*args: Any, **kwargs: Any) -> Any:
        params = [p for chunk in _chunks(kwargs["model"]) for p in chunk.parameters()]
        meter = ActivationMeter(params)
        gpu = torch.cuda.is_available()
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
        with meter.measuring():
            result = forward_backward(*args, **kwargs)
        peaks.append(meter.peak)
        if gpu:
            torch.cuda.synchronize()
            cuda_peaks.append(torch.cuda.max_memory_allocated() - start)
        record = {"rank": int(os.environ["RANK"]), "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                  "peaks": peaks, "cuda_peaks": cuda_peaks}
        (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
        return result

    return run


def install(out: Path) -> None:
    """Wrap ``train_step`` (its ``forward_backward_func`` argument, the 7th) with the meter."""
    from megatron.training import training

    train_step, peaks, cuda_peaks = training.train_step, [], []

    def step(*args: Any, **kwargs: Any) -> Any:
        if "forward_backward_func" in kwargs:
            kwargs["forward_backward_func"] = metered(kwargs["forward_backward_func"], out, peaks, cuda_peaks)
        else:
            args = (*args[:6], metered(args[6], out, peaks, cuda_peaks), *args[7:])
        return train_step(*args, **kwargs)

    training.train_step = step


if __name__ == "__main__":
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    out = Path(os.environ[OUT_ENV])
    out.mkdir(parents=True, exist_ok=True)
    install(out)
    runpy.run_path(str(SCRIPT), run_name="__main__")
