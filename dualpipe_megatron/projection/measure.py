"""Time one chunk's F, B, B(w=false), W and an F-then-B pair on this machine's CPU or GPU.

Single process, no communication: what is timed is the compute a pipeline rank
does per op (the all-to-all is a local permutation, see :mod:`.layer`). Each
op is timed ``repeats`` times after ``warmup`` rounds and the median kept; a
GPU is synchronised around every timed op, and a single CPU thread is timed by
its process's CPU time so that a busy host does not inflate the figures. Weight grads accumulate across
rounds as under gradient accumulation.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import torch

from ..runtime.wgrad import WeightGradStore, deferring
from ..schedules.model_shape import ModelShape
from .count import ChunkCount, count_chunk
from .layer import build_chunk, chunk_input
from .shapes import ProjectionError, shape_from_json, shape_to_json

OPS = ("F", "B", "B_input", "W", "F_then_B")
FORMAT = "dualpipe-op-costs/2"
READS = (FORMAT, "dualpipe-op-costs/1")  # /1: the same without measured communication
DIRECTIONS = ("forward", "backward")
_KEY = "measure"


@dataclass(frozen=True)
class OpCosts:
    """ms per op of one micro-batch through a chunk of ``shape``, measured on ``device``.

    ``ms`` is compute only. ``comm_ms`` (None when not measured, as by :func:`measure`)
    is the measured MoE all-to-all of the same micro-batch and chunk per direction:
    dispatch + combine going ``forward``, their grads going ``backward``.
    ``exposed_share`` (None when not measured) is the communication an overlapped F&B
    pair left exposed, as a share of the shorter of its compute and its communication:
    the projection's ``--overlap-loss``.
    """

    shape: ModelShape  # a stage shape (:mod:`.shapes`)
    ms: dict[str, float]
    flops: ChunkCount  # of the measured shape
    device: str
    dtype: str
    info: dict[str, Any] = field(default_factory=dict)
    comm_ms: dict[str, float] | None = None
    exposed_share: float | None = None

    def to_json_obj(self) -> dict[str, Any]:
        return {"format": FORMAT, "device": self.device, "dtype": self.dtype,
                "shape": shape_to_json(self.shape), "ms": self.ms, "comm_ms": self.comm_ms,
                "exposed_share": self.exposed_share,
                "flops": {k: getattr(self.flops, k) for k in ("F", "B", "B_input", "W")},
                "info": self.info}

    @classmethod
    def from_json_obj(cls, obj: Any) -> "OpCosts":
        """Parse an op-cost file; the FLOPs are recounted from its shape, not trusted."""
        if not isinstance(obj, dict) or obj.get("format") not in READS:
            raise ProjectionError(f"not an op-cost file (want format {FORMAT!r})")
        shape = shape_from_json(obj.get("shape"))
        try:
            ms = {op: float(obj["ms"][op]) for op in OPS}
        except (KeyError, TypeError, ValueError) as exc:
            raise ProjectionError(f"op-cost file: bad or missing ms entry {exc}") from None
        bad = [op for op, v in ms.items() if not v > 0]
        if bad:
            raise ProjectionError(f"op-cost file: ms must be positive for {', '.join(bad)}")
        if ms["W"] >= ms["B"]:
            raise ProjectionError(f"op-cost file: W ({ms['W']}) must be less than B ({ms['B']})")
        return cls(shape, ms, count_chunk(shape), str(obj.get("device", "?")),
                   str(obj.get("dtype", "?")), dict(obj.get("info") or {}),
                   _comm(obj.get("comm_ms")), _share(obj.get("exposed_share")))


def _comm(value: Any) -> dict[str, float] | None:
    if value is None:
        return None
    try:
        comm = {d: float(value[d]) for d in DIRECTIONS}
    except (KeyError, TypeError, ValueError) as exc:
        raise ProjectionError(f"op-cost file: comm_ms needs forward and backward ms ({exc!r})") from None
    if not all(v >= 0 for v in comm.values()):
        raise ProjectionError(f"op-cost file: comm_ms must be >= 0, got {comm}")
    return comm


def _share(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ProjectionError(f"op-cost file: exposed_share must be a number within [0, 1], got {value!r}")
    return float(value)


def _clock(device: torch.device) -> tuple[str, Callable[[], float]]:
    """Wall clock, except on one CPU thread: there the process's CPU time, which other
    processes sharing the cores do not inflate."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return "process cpu time", time.process_time
    return "wall clock", time.perf_counter


def _timer(device: torch.device, clock: Callable[[], float]) -> Callable[[Callable[[], Any]], float]:
    def timed(fn: Callable[[], Any]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (clock() - start) * 1e3
    return timed


def measure(shape: ModelShape, device: str = "auto", dtype: str = "auto",
            repeats: int = 7, warmup: int = 2, seed: int = 0) -> OpCosts:
    """Median ms of each op in :data:`OPS`; bf16 on a GPU and fp32 on a CPU unless told."""
    if repeats < 1 or warmup < 0:
        raise ProjectionError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available()
                       else "cpu" if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProjectionError("--device cuda asked for, but torch sees no GPU")
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ProjectionError(f"unknown dtype {dtype!r}")
    torch.manual_seed(seed)
    chunk = build_chunk(shape, dev, torch_dtype)
    clock_name, clock = _clock(dev)
    timed = _timer(dev, clock)

    def x() -> torch.Tensor:
        return chunk_input(shape, dev, torch_dtype)

    grad = torch.randn(shape.micro_batch, shape.seq, shape.hidden, device=dev, dtype=torch_dtype)
    samples: dict[str, list[float]] = {op: [] for op in OPS}
    for round_ in range(warmup + repeats):
        got: dict[str, float] = {}
        out: list[torch.Tensor] = []
        inp = x()
        got["F"] = timed(lambda: out.append(chunk(inp)))
        got["B"] = timed(lambda: out.pop().backward(grad))
        y = chunk(x())
        with deferring(_KEY):
            got["B_input"] = timed(lambda: y.backward(grad))
        got["W"] = timed(lambda: WeightGradStore.pop(_KEY))
        earlier, later = chunk(x()), x()
        got["F_then_B"] = timed(lambda: (chunk(later), earlier.backward(grad)))
        if round_ >= warmup:
            for op, ms in got.items():
                samples[op].append(ms)
    ms = {op: statistics.median(v) for op, v in samples.items()}
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (
        f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    info = {"measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "clock": clock_name, "repeats": repeats, "warmup": warmup,
            "min_ms": {op: min(v) for op, v in samples.items()},
            "max_ms": {op: max(v) for op, v in samples.items()}}
    return OpCosts(shape, ms, count_chunk(shape), name, dtype, info)


__all__ = ["DIRECTIONS", "FORMAT", "OPS", "OpCosts", "READS", "measure"]
