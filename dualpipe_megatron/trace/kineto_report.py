"""Text and JSON reports of profiled ranks (``trace profile``), from :mod:`.kineto`'s measurements."""

from __future__ import annotations

from typing import Any, Sequence

from .kineto import OUTSIDE, PairTime, PhaseTime, RankProfile

FORMAT = "dualpipe-megatron-profile/1"
PASSES = ("F", "B", "W", "FB")


def _ms(x: float) -> float:
    return round(x, 3)  # µs resolution, as the trace records


def pass_totals(profile: RankProfile) -> dict[str, dict[str, float]]:
    """Per pass (F, B, W, FB) present: ranges, host ms and GPU compute/communication ms summed over its phases."""
    out: dict[str, dict[str, float]] = {}
    for ph in profile.phases.values():
        if ph.kind is None:
            continue
        t = out.setdefault(ph.kind, {"ranges": 0, "host_ms": 0.0, "compute_ms": 0.0, "communication_ms": 0.0})
        t["ranges"] += ph.count
        t["host_ms"] += ph.host_ms
        t["compute_ms"] += ph.compute_ms
        t["communication_ms"] += ph.communication_ms
    return {k: out[k] for k in PASSES if k in out}


def _phase_json(ph: PhaseTime) -> dict[str, Any]:
    return {"kind": ph.kind, "part": ph.part, "stages": list(ph.stages), "input_grad_only": ph.input_grad_only,
            "count": ph.count, "host_ms": _ms(ph.host_ms), "compute_ms": _ms(ph.compute_ms),
            "communication_ms": _ms(ph.communication_ms),
            "by_stream": {str(s): _ms(v) for s, v in ph.by_stream.items()}}


def _pair_json(p: PairTime) -> dict[str, Any]:
    return {"name": p.name, "start_ms": _ms(p.start_ms), "host_ms": _ms(p.host_ms), "window_ms": _ms(p.window_ms),
            "compute_ms": _ms(p.compute_ms), "communication_ms": _ms(p.communication_ms),
            "hidden_communication_ms": _ms(p.hidden_communication_ms),
            "exposed_communication_ms": _ms(p.exposed_communication_ms), "phases": list(p.phases)}


def rank_json(r: RankProfile) -> dict[str, Any]:
    """One rank as JSON: the fields of :class:`RankProfile`, ms rounded to µs, plus per-pass totals."""
    return {
        "file": str(r.path), "rank": r.rank, "world_size": r.world_size, "device": r.device, "gpu": r.gpu,
        "window_ms": _ms(r.window_ms), "compute_ms": _ms(r.compute_ms), "communication_ms": _ms(r.communication_ms),
        "hidden_communication_ms": _ms(r.hidden_communication_ms),
        "exposed_communication_ms": _ms(r.exposed_communication_ms), "exposed_share": round(r.exposed_share, 5),
        "gpu_events": len(r.events), "unlinked_events": r.unlinked,
        "streams": [{"id": s.id, "kind": s.kind, "busy_ms": _ms(s.busy_ms), "compute_ms": _ms(s.compute_ms),
                     "communication_ms": _ms(s.communication_ms), "events": s.events} for s in r.streams],
        "phases": {name: _phase_json(ph) for name, ph in r.phases.items()},
        "passes": {k: {f: (_ms(v) if f.endswith("_ms") else v) for f, v in t.items()}
                   for k, t in pass_totals(r).items()},
        "pairs": [_pair_json(p) for p in r.pairs],
    }


def profiles_json(profiles: Sequence[RankProfile]) -> dict[str, Any]:
    return {"format": FORMAT, "ranks": [rank_json(r) for r in profiles]}


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda row: "    " + "  ".join(  # noqa: E731
        str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    return [fmt(header), *(fmt(r) for r in rows)]


def _title(r: RankProfile) -> str:
    of = f" of {r.world_size}" if r.world_size else ""
    gpu = f", GPU {r.device}" if r.device is not None else ""
    return f"rank {r.rank}{of}{gpu} ({r.path.name})"


def format_rank(r: RankProfile) -> str:
    """A rank's text report: totals, streams, phases, passes and F&B pairs."""
    if not r.gpu:
        lines = [f"{_title(r)}: no GPU events (a CPU run), so host-side range times only; "
                 f"host window {r.window_ms:.2f} ms"]
        rows = [(name, ph.kind or "", ph.count, f"{ph.host_ms:.3f}") for name, ph in r.phases.items()]
        lines += _table(("range", "pass", "count", "host ms"), rows) if rows else ["    no profiler ranges"]
        return "\n".join(lines)
    linked = ("all linked to their launches" if not r.unlinked
              else f"{r.unlinked} with no launch in the trace (counted under {OUTSIDE})")
    w = r.window_ms
    lines = [
        f"{_title(r)}: {len(r.events)} GPU events, {linked}",
        f"  window {w:.2f} ms; compute {r.compute_ms:.2f} ms ({_pct(r.compute_ms, w)}), communication "
        f"{r.communication_ms:.2f} ms ({_pct(r.communication_ms, w)}): hidden under compute "
        f"{r.hidden_communication_ms:.2f} ms, exposed {r.exposed_communication_ms:.2f} ms "
        f"({_pct(r.exposed_communication_ms, w)} of the window)",
        "  streams:",
        *_table(("stream", "kind", "busy ms", "compute ms", "comm ms", "events"),
                [(s.id, s.kind, f"{s.busy_ms:.2f}", f"{s.compute_ms:.2f}", f"{s.communication_ms:.2f}", s.events)
                 for s in r.streams]),
        "  phases (GPU time of the work launched in each range, innermost range only):",
        *_table(("range", "pass", "count", "host ms", "compute ms", "comm ms", "GPU ms by stream"),
                [(name, ph.kind or "", ph.count, f"{ph.host_ms:.2f}", f"{ph.compute_ms:.2f}",
                  f"{ph.communication_ms:.2f}", " ".join(f"{s}:{v:.2f}" for s, v in ph.by_stream.items()) or "-")
                 for name, ph in r.phases.items()]),
    ]
    passes = pass_totals(r)
    if passes:
        lines.append("  by pass: " + "; ".join(
            f"{k} {t['compute_ms']:.2f} ms compute + {t['communication_ms']:.2f} ms comm ({t['ranges']} ranges)"
            for k, t in passes.items()))
    if r.pairs:
        lines.append("  F&B pairs (communication launched in the pair, against all of the rank's compute):")
        lines += _table(("pair", "GPU window ms", "compute ms", "comm ms", "hidden ms", "exposed ms"),
                        [(p.name, f"{p.window_ms:.2f}", f"{p.compute_ms:.2f}", f"{p.communication_ms:.2f}",
                          f"{p.hidden_communication_ms:.2f}", f"{p.exposed_communication_ms:.2f}")
                         for p in r.pairs])
    return "\n".join(lines)


def format_profiles(profiles: Sequence[RankProfile]) -> str:
    return "\n\n".join(format_rank(r) for r in profiles)


__all__ = ["FORMAT", "format_profiles", "format_rank", "pass_totals", "profiles_json", "rank_json"]
