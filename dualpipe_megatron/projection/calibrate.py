"""Op costs from a GPU profile: ``projection calibrate`` reads what a real run measured.

The trace is read by :func:`..trace.kineto.read_profiles` (kernels linked to the
range that launched them); this module only turns its phases into an op-cost file
(:class:`~.measure.OpCosts`, per layer: the shape written has ``layers = 1``):

- **Compute** per op is the summed duration of the compute kernels launched in
  the ranges of that pass, per layer. Our ranges (``dualpipe F/B/W ...``) each
  hold one chunk of ``layers_per_chunk`` layers: F from lone forwards, B from
  full backwards, B_input from ``w=false`` backwards, W from W ops (B = B_input
  + W where a trace has no full backward, and the other way round). DeepSeek's
  ranges (``attn(F)``, ``mlp(B)``, ``dispatch(F)``, ...) each hold one sub-layer,
  so a pass's most frequent sub-layer name counts its layers; their B ranges
  are input grads, W has its own.
- **F_then_B** is an F&B pair's compute: the union of its compute kernels (a
  second stream overlaps them), per layer, plus W where the pair's backward
  left W for later. Without pairs it is F + B.
- **Communication** per direction is the summed duration of communication
  kernels launched in forward (F) and in backward (B) ranges, per layer. In our
  ranges that is everything the op sends, pipeline p2p included.
- **Exposed share** is, over all pairs, the communication left outside every
  compute kernel of the rank divided by the shorter of the pairs' compute and
  communication: the projection's ``--overlap-loss``, measured, not fitted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..schedules.model_shape import ModelShape
from ..trace.kineto import PairTime, PhaseTime, RankProfile, read_events
from .count import count_chunk
from .measure import OpCosts
from .shapes import ProjectionError


@dataclass
class _Pass:
    """Summed compute and communication ms of one pass, and how many chunks or layers ran it."""

    compute: float = 0.0
    comm: float = 0.0
    units: int = 0


def _per(total: float, units: int) -> float:
    return total / units if units else 0.0


def _ours(phase: PhaseTime) -> str | None:
    """The op a ``dualpipe ...`` range ran: F, B (full), B_input, W or FB; None for others."""
    if phase.part is not None or phase.kind is None:
        return None
    return "B_input" if phase.kind == "B" and phase.input_grad_only else phase.kind


def _passes(profiles: Sequence[RankProfile], layers_per_chunk: int | None) -> tuple[dict[str, _Pass], str]:
    """Per op, summed ms and units (layers), over every rank; and which naming the trace uses."""
    passes = {op: _Pass() for op in ("F", "B", "B_input", "W")}
    parts = [p for r in profiles for p in r.phases.values() if p.part is not None]
    if parts:
        for kind, op in (("F", "F"), ("B", "B_input"), ("W", "W")):
            mine = [p for p in parts if p.kind == kind]
            passes[op].compute = sum(p.compute_ms for p in mine)
            passes[op].comm = sum(p.communication_ms for p in mine)
            for r in profiles:  # a pass's layers: its most frequent sub-layer, rank by rank
                counts = [p.count for p in r.phases.values() if p.part is not None and p.kind == kind]
                passes[op].units += max(counts, default=0)
        return passes, "DeepSeek's sub-layer ranges (attn(F), dispatch(B), mlp(W), ...)"
    if layers_per_chunk is None:
        raise ProjectionError("the trace's dualpipe ranges hold whole chunks: give --layers-per-chunk "
                              "(layers per pipeline stage of the traced run)")
    for p in (p for r in profiles for p in r.phases.values()):
        op = _ours(p)
        if op in passes:
            passes[op].compute += p.compute_ms
            passes[op].comm += p.communication_ms
            passes[op].units += p.count * layers_per_chunk
    return passes, f"dualpipe op ranges, {layers_per_chunk} layers per chunk"


def _pair_layers(pair: PairTime, rank: RankProfile, layers_per_chunk: int | None) -> int:
    """Layers one pair ran forward (and backward): sub-layer ranges of its F, else the option."""
    forwards = Counter(n for n in pair.phases if rank.phases[n].part is not None and rank.phases[n].kind == "F")
    if forwards:
        return max(forwards.values())
    if layers_per_chunk is None:
        raise ProjectionError(f"pair {pair.name!r} has no sub-layer ranges: give --layers-per-chunk")
    return layers_per_chunk


def _pair_has_w(pair: PairTime, rank: RankProfile) -> bool:
    """Whether the pair's backward computed its weight grads (else a later W did)."""
    own = rank.phases.get(pair.name)
    if own is not None and own.kind == "FB":
        return not own.input_grad_only
    return any(rank.phases[n].kind == "W" for n in pair.phases if n in rank.phases)


def calibrate(profiles: Sequence[RankProfile], shape: ModelShape,
              layers_per_chunk: int | None = None) -> OpCosts:
    """Per-layer op costs of ``shape`` (a stage shape, any ``num_layers``; one is written) from GPU profiles.

    Every rank's ranges are pooled. Raises :class:`ProjectionError` for a trace
    without GPU work or without the passes an op-cost file needs.
    """
    if layers_per_chunk is not None and layers_per_chunk < 1:
        raise ProjectionError(f"--layers-per-chunk must be >= 1, got {layers_per_chunk}")
    host_only = [str(r.path) for r in profiles if not r.gpu]
    if host_only:
        raise ProjectionError(f"{', '.join(host_only)}: no GPU kernels (a CPU run's trace has host "
                              f"times only); calibrate needs a GPU profile")
    passes, naming = _passes(profiles, layers_per_chunk)
    ms = {op: _per(p.compute, p.units) for op, p in passes.items()}
    if not ms["B"]:
        ms["B"] = ms["B_input"] + ms["W"]
    if not ms["B_input"] and ms["W"]:
        ms["B_input"] = ms["B"] - ms["W"]
    missing = [op for op in ("F", "B", "B_input", "W") if not ms[op] > 0]
    if missing:
        raise ProjectionError(f"the trace has no GPU compute for {', '.join(missing)} ({naming}): "
                              f"calibrate needs forwards, backwards and weight-grad passes")
    pairs = [(r, p) for r in profiles for p in r.pairs]
    pair_layers = [_pair_layers(p, r, layers_per_chunk) for r, p in pairs]
    layers = sum(pair_layers)
    if layers:
        ms["F_then_B"] = sum(p.compute_ms + (0 if _pair_has_w(p, r) else ms["W"] * n)
                             for (r, p), n in zip(pairs, pair_layers)) / layers
    else:
        ms["F_then_B"] = ms["F"] + ms["B"]
    back = (passes["B"], passes["B_input"])
    comm = {"forward": _per(passes["F"].comm, passes["F"].units),
            "backward": _per(sum(p.comm for p in back), sum(p.units for p in back))}
    shorter = sum(min(p.compute_ms, p.communication_ms) for _, p in pairs)
    share = sum(p.exposed_communication_ms for _, p in pairs) / shorter if shorter else None
    info: dict[str, Any] = {
        "source": "calibrate", "traces": sorted({str(r.path) for r in profiles}),
        "ranks": len(profiles), "naming": naming,
        "layers_per_chunk": layers_per_chunk or (layers // len(pairs) if pairs else None),
        "ms_are": "per layer: compute kernels' summed duration per pass; F_then_B the union in a pair",
        "pairs": len(pairs), "pair_layers": layers,
        "pair_measured_ms": {key: sum(getattr(p, key + "_ms") for _, p in pairs) / len(pairs)
                             for key in ("window", "compute", "communication", "hidden_communication",
                                         "exposed_communication")} if pairs else None,
        "window_ms": [r.window_ms for r in profiles],
        "exposed_communication_ms": [r.exposed_communication_ms for r in profiles],
    }
    one = replace(shape, num_layers=1)
    device = ", ".join(sorted({_device_name(r) for r in profiles}))
    return OpCosts(one, ms, count_chunk(one), device, "as traced", info,
                   comm if any(comm.values()) else None, share)


def _device_name(rank: RankProfile) -> str:
    """The GPU's name from the trace's ``deviceProperties`` (Kineto writes them), else a placeholder."""
    _, meta = read_events(rank.path)
    props = meta.get("deviceProperties")
    if isinstance(props, list):
        for d in props:
            if isinstance(d, dict) and d.get("id") == rank.device and d.get("name"):
                return str(d["name"])
    return "GPU (unnamed in the trace)"


__all__ = ["calibrate"]
