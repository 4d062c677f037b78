"""Per-stage op times of the projected job, and how communication enters each op.

Compute comes from measured op costs scaled to the target shape by FLOP ratio
(each op by its own ratio), or from FLOP counts at an assumed rate. The
all-to-all then enters the simulator's constant op costs as follows:

- F = F_compute + A2A_fwd and B = B_compute + A2A_bwd: a lone forward or
  backward waits for its own dispatch and combine. W moves nothing.
- an F&B pair (DualPipe, DualPipeV, Megatron's combined 1F1B) hides each half's
  all-to-all behind the other half's compute:
  ``FB = max(C, A) + loss * min(C, A)`` with C the measured F-then-B compute
  and A = A2A_fwd + A2A_bwd. ``loss`` = 0 is perfect overlap, 1 none at all.
- a pair whose backward defers its weight grad costs FB - W (the simulator's
  rule): the deferred W is assumed not needed to hide the pair's all-to-all.
- p2p is the simulator's latency ``c`` on every cross-rank dependency; it
  occupies no compute (sends are asynchronous).

Measured all-to-all (an op-cost file with ``comm_ms``, from ``calibrate``) replaces
the network model's, scaled to the target by the network model's own ratio
``a2a_ms(target) / a2a_ms(measured shape)`` under the same links: payload bytes
(tokens x hidden, the copies top-k and the node limit make) and, where EP differs,
how the split between inter-node and NVLink traffic changes. The link speeds
themselves cancel out, so a measured figure keeps its effective bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..schedules.ir import B, F, FB, Op, W
from ..schedules.model_shape import ModelShape
from ..schedules.simulate import Costs
from .comm import Network, a2a_ms, p2p_ms
from .count import ChunkCount
from .measure import OpCosts
from .shapes import ProjectionError

DEFAULT_TFLOPS = 400.0  # assumed achieved bf16 rate for the built-in costs


@dataclass(frozen=True)
class StageTimes:
    """ms for one micro-batch through one 1/P stage of the target job."""

    F: float  # compute only
    B: float
    W: float
    FB: float  # compute of an F-then-B pair, no overlap
    a2a_fwd: float
    a2a_bwd: float
    p2p: float
    source: str  # where the compute numbers come from
    comm_source: str = "network model"  # where the all-to-all comes from

    @property
    def a2a(self) -> float:
        return self.a2a_fwd + self.a2a_bwd


def compute_ms(target: ChunkCount, measured: OpCosts | None,
               tflops: float | None) -> tuple[dict[str, float], str]:
    """Compute ms of F, B, W and an F-then-B pair at the target shape, and a label saying how.

    Measured costs scale by each op's FLOP ratio (target / measured shape); with
    ``tflops`` they are then rescaled together so the forward runs at that rate,
    keeping the measured ratios between ops.
    """
    if tflops is not None and not tflops > 0:
        raise ProjectionError(f"--tflops must be positive, got {tflops}")
    if measured is None:
        rate = tflops or DEFAULT_TFLOPS
        ms = {op: getattr(target, op) / (rate * 1e9) for op in ("F", "B", "W")}
        ms["FB"] = ms["F"] + ms["B"]
        return ms, f"built-in: FLOP counts at {rate:g} TFLOP/s (not measured)"
    got, flops = measured.ms, measured.flops
    ms = {op: got[op] * getattr(target, op) / getattr(flops, op) for op in ("F", "B", "W")}
    ms["FB"] = got["F_then_B"] * (target.F + target.B) / (flops.F + flops.B)
    label = f"measured on {measured.device} ({measured.dtype}), scaled by FLOP ratio"
    if tflops is not None:
        rebase = flops.F / (tflops * 1e9 * got["F"])  # measured rate / wanted rate
        ms = {op: v * rebase for op, v in ms.items()}
        label += f", rebased so F runs at {tflops:g} TFLOP/s"
    return ms, label


def a2a_stage_ms(target: ModelShape, measured: OpCosts | None, net: Network) -> tuple[float, float, str]:
    """All-to-all ms of one stage, forward and backward, and where it comes from."""
    model = a2a_ms(target, net)
    if measured is None or measured.comm_ms is None:
        return model, model, "network model"
    scale = model / a2a_ms(measured.shape, net)
    return (measured.comm_ms["forward"] * scale, measured.comm_ms["backward"] * scale,
            f"measured on {measured.device}, scaled by the network model's ratio x{scale:.3g}")


def stage_times(target: ModelShape, count: ChunkCount, measured: OpCosts | None,
                tflops: float | None, net: Network) -> StageTimes:
    """Compute and communication ms of one stage (``target.num_layers`` MoE layers) of the job."""
    ms, label = compute_ms(count, measured, tflops)
    fwd, bwd, comm = a2a_stage_ms(target, measured, net)
    return StageTimes(F=ms["F"], B=ms["B"], W=ms["W"], FB=ms["FB"], a2a_fwd=fwd,
                      a2a_bwd=bwd, p2p=p2p_ms(target, net), source=label, comm_source=comm)


def overlapped_fb(compute: float, comm: float, loss: float) -> float:
    """An F&B pair: compute and all-to-all run side by side; ``loss`` of the shorter one shows."""
    if not 0 <= loss <= 1:
        raise ProjectionError(f"overlap loss must be within [0, 1], got {loss}")
    return max(compute, comm) + loss * min(compute, comm)


def microseconds(ms: float) -> Fraction:
    """ms rounded to whole microseconds, exact (keeps the simulator's fractions small)."""
    return Fraction(round(ms * 1000), 1000)


def schedule_costs(t: StageTimes, overlap: bool, loss: float) -> Costs:
    """Simulator costs of one stage; ``overlap`` when the schedule runs F&B pairs."""
    f, b = t.F + t.a2a_fwd, t.B + t.a2a_bwd
    fb = overlapped_fb(t.FB, t.a2a, loss) if overlap else f + b
    return Costs.of(microseconds(f), microseconds(b), microseconds(t.W), microseconds(fb),
                    microseconds(t.p2p))


def exposed_a2a(op: Op, t: StageTimes, loss: float) -> float:
    """ms of all-to-all an op leaves on its rank's critical path."""
    if isinstance(op, F):
        return t.a2a_fwd
    if isinstance(op, B):
        return t.a2a_bwd
    if isinstance(op, W):
        return 0.0
    assert isinstance(op, FB)
    return overlapped_fb(t.FB, t.a2a, loss) - t.FB


__all__ = ["DEFAULT_TFLOPS", "StageTimes", "a2a_stage_ms", "compute_ms", "exposed_a2a", "overlapped_fb",
           "schedule_costs", "stage_times"]
