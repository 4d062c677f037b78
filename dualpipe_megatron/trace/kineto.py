"""PyTorch-profiler Chrome traces read back: GPU work linked to its launch, phases, hidden communication.

This is the reading side of ``python -m dualpipe_megatron.trace profile``, and an API
for other tools (``projection calibrate``). It reads Kineto's Chrome traces
(``.json`` or ``.json.gz``): Megatron's ``--profile --use-pytorch-profiler`` output
(one file per rank), any ``torch.profiler.profile(...).export_chrome_trace`` file,
and DeepSeek's published ``profile-data/train.json``.

How a trace is read (docs/traces.md has the long form):

- **Linking.** Every kernel, memcpy and memset on a GPU carries a correlation id
  (``args.correlation``); the CUDA runtime/driver call that launched it
  (``cudaLaunchKernel``, ``cuLaunchKernel``, ``cudaMemcpyAsync``, ...) carries the
  same id, on whichever CPU thread made it. That call's start is the launch time.
- **Phases.** A GPU event belongs to the innermost profiler range
  (``record_function`` / ``user_annotation``; ``ProfilerStep#N`` excluded) that holds
  its launch time: on the launching thread if that thread has such a range, else on
  any other thread of the same process, by time. So the autograd engine's thread,
  which has no ranges of its own, is placed inside the main thread's ``dualpipe B``
  (or DeepSeek's ``attn(B)``) range that is open while it runs.
- **Classification.** By kernel name, never by stream: NCCL, DeepEP
  (``dpsk::ep``/``deep_ep``), NVSHMEM, userbuffers kernels and peer-to-peer copies
  are communication (:data:`COMMUNICATION`); everything else is compute.
- **Overlap.** Compute and communication are unions of their events' spans
  (streams overlap, so durations are not added); hidden communication is
  communication ∩ compute, exposed is communication − compute.

All times in the API are milliseconds (``*_ms``); trace timestamps are µs.
"""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..runtime.profiler_ranges import NAME as DUALPIPE_NAME
from .intervals import Span, intersect, length, subtract, union
from .records import TraceError

# Communication kernels, by name: NCCL, DeepEP (DeepSeek's trace spells it dpsk::ep), NVSHMEM,
# Transformer Engine's userbuffers, and device-to-device copies between GPUs.
COMMUNICATION = re.compile(r"nccl|deep_?ep|dpsk::ep|nvshmem|userbuffers|PtoP|Peer to Peer", re.IGNORECASE)
# DeepSeek's range names: attn(F), dispatch(B), mlp(W), combine(F), ...
PART_NAME = re.compile(r"(?P<part>\w+)\((?P<kind>[FBW])\)")
OUTSIDE = "(no range)"  # phase of GPU work launched outside every range, or whose launch is not in the trace

_GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset"})
_LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
_RANGE_CAT = "user_annotation"
_STEP_RANGE = "ProfilerStep#"
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)")
_US_PER_MS = 1000.0


@dataclass(frozen=True)
class GpuEvent:
    """One kernel, memcpy or memset, with its launch and phase; times in µs on the trace's clock."""

    name: str
    stream: int
    start: float
    end: float
    communication: bool
    launch: float | None  # host start of the launching call; None: its correlation id matched no launch
    phase: str  # name of the innermost range holding the launch, else OUTSIDE


@dataclass(frozen=True)
class StreamTime:
    """One CUDA stream of a rank: ``busy_ms`` is the union of its events' spans."""

    id: int
    kind: str  # "compute" or "communication": the class of most of its busy time
    busy_ms: float
    compute_ms: float
    communication_ms: float
    events: int


@dataclass(frozen=True)
class PhaseTime:
    """Every range of one name on a rank, and the GPU work launched inside it (innermost range only).

    ``kind`` is the pass the name says: ``F``, ``B``, ``W`` or ``FB`` (an overlapped
    F&B pair) for our ``dualpipe ...`` names and DeepSeek's ``attn(F)``-style names,
    None for any other range (and for OUTSIDE). ``part`` is DeepSeek's sub-layer
    (``attn``, ``mlp``, ``dispatch``, ``combine``), None for our names.
    ``stages`` are the schedule stages of our names (F's then B's for a pair).
    ``input_grad_only`` is True where the name says the B leaves its weight grad
    to a later W (our ``w=false``). GPU times are summed event durations
    (an event counts once, in its innermost phase); ``by_stream`` splits them by
    stream. ``host_ms`` is the ranges' summed duration on the CPU, nested ranges
    included.
    """

    name: str
    kind: str | None
    part: str | None
    stages: tuple[int, ...]
    input_grad_only: bool
    count: int
    host_ms: float
    compute_ms: float
    communication_ms: float
    by_stream: dict[int, float]

    @property
    def gpu_ms(self) -> float:
        return self.compute_ms + self.communication_ms


@dataclass(frozen=True)
class PairTime:
    """One F&B pair range and the GPU work launched while it was open (any thread of the process).

    Pairs are our ``dualpipe FB ...`` ranges; in a trace without them, a range of no
    pass of its own whose direct children include F and B passes (DeepSeek's
    ``1F1B``). ``compute_ms``/``communication_ms`` are unions over the pair's own
    events; hidden/exposed split its communication against the whole rank's
    compute (work of a neighbouring op hides communication just as well).
    ``start_ms`` is the range's host start from the rank's ``origin``.
    """

    name: str
    start_ms: float
    host_ms: float
    window_ms: float
    compute_ms: float
    communication_ms: float
    hidden_communication_ms: float
    exposed_communication_ms: float
    phases: tuple[str, ...]  # names of the ranges nested in it, in order


@dataclass(frozen=True)
class RankProfile:
    """One rank (one GPU of one trace file) measured.

    With GPU events (``gpu`` True): ``window_ms`` runs from the first GPU event's
    start to the last one's end; ``compute_ms`` and ``communication_ms`` are the
    unions of compute and communication events; ``hidden_communication_ms`` is
    their intersection and ``exposed_communication_ms`` the communication outside
    compute (hidden + exposed = communication). A CPU-only trace (``gpu`` False,
    our CPU runs) has no GPU quantities (all 0, no streams): ``window_ms`` is the
    span of its host events and only the phases' ``host_ms`` are measured.
    ``origin`` (µs) is where the window starts; ``events`` are the GPU events in
    start order; ``unlinked`` counts GPU events whose launch is not in the trace.
    """

    path: Path
    rank: int
    world_size: int | None
    device: int | None
    gpu: bool
    origin: float
    window_ms: float
    compute_ms: float
    communication_ms: float
    hidden_communication_ms: float
    exposed_communication_ms: float
    streams: list[StreamTime]
    phases: dict[str, PhaseTime]
    pairs: list[PairTime]
    events: tuple[GpuEvent, ...]
    unlinked: int

    @property
    def exposed_share(self) -> float:
        """Exposed communication as a fraction of the window (0 without GPU events)."""
        return self.exposed_communication_ms / self.window_ms if self.gpu and self.window_ms else 0.0


@dataclass(frozen=True)
class _Range:
    name: str
    tid: Any
    start: float
    end: float
    parent: int  # index in the thread's list, -1 for none


def read_events(path: str | os.PathLike[str]) -> tuple[list[dict], dict]:
    """A trace file's ``traceEvents`` and its other top-level keys; gzip is recognised by content."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(f"{p}: not a readable gzip file ({exc})") from None
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceError(f"{p}: not JSON ({exc}); expected a PyTorch-profiler Chrome trace") from None
    if isinstance(doc, list):  # the Chrome format's bare array of events
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict):
        raise TraceError(f"{p}: not a Chrome trace (top level is a JSON {type(doc).__name__}, "
                         f"expected an object with traceEvents)")
    events = doc.get("traceEvents")
    if events is None:
        keys = ", ".join(sorted(doc)[:8]) or "none"
        raise TraceError(f"{p}: no traceEvents key (top-level keys: {keys}); "
                         f"expected a PyTorch-profiler Chrome trace")
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise TraceError(f"{p}: traceEvents is not a list of event objects")
    return events, {k: v for k, v in doc.items() if k != "traceEvents"}


def _complete(events: list[dict], path: Path) -> list[dict]:
    """The complete ('X') events, with numeric ts and dur checked."""
    out = [e for e in events if e.get("ph") == "X"]
    if not out:
        raise TraceError(f"{path}: traceEvents holds no complete ('ph': 'X') events, so no ranges, "
                         f"CPU ops or kernels to analyse")
    for e in out:
        ts, dur = e.get("ts"), e.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            raise TraceError(f"{path}: event {e.get('name', '?')!r} has no numeric ts/dur "
                             f"(ts={ts!r}, dur={dur!r})")
    return out


def _cat(e: dict) -> str:
    return str(e.get("cat", "")).lower()


def _thread_ranges(ranges: list[dict]) -> list[_Range]:
    """One thread's ranges by start, each with the innermost range enclosing it."""
    out: list[_Range] = []
    stack: list[int] = []
    for e in sorted(ranges, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        while stack and out[stack[-1]].end <= start:
            stack.pop()
        out.append(_Range(str(e["name"]), e.get("tid"), start, end, stack[-1] if stack else -1))
        stack.append(len(out) - 1)
    return out


def _innermost(ranges: list[_Range], starts: list[float], t: float) -> _Range | None:
    i = bisect.bisect_right(starts, t) - 1
    while i >= 0:
        r = ranges[i]
        if r.end >= t:
            return r
        i = r.parent
    return None


class _Placer:
    """Finds the phase of a launch: the innermost range holding it, own thread first."""

    def __init__(self, ranges: list[dict]) -> None:
        by_thread: dict[tuple[Any, Any], list[dict]] = {}
        for e in ranges:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        self.threads = {k: _thread_ranges(v) for k, v in by_thread.items()}
        self.starts = {k: [r.start for r in v] for k, v in self.threads.items()}

    def place(self, pid: Any, tid: Any, t: float) -> str:
        own = (pid, tid)
        if own in self.threads:
            hit = _innermost(self.threads[own], self.starts[own], t)
            if hit is not None:
                return hit.name
        best: _Range | None = None
        for key, ranges in self.threads.items():
            if key[0] != pid or key == own:
                continue
            hit = _innermost(ranges, self.starts[key], t)
            if hit is not None and (best is None or (hit.start, best.end) > (best.start, hit.end)):
                best = hit
        return best.name if best is not None else OUTSIDE


def _name_parts(name: str) -> tuple[str | None, str | None, tuple[int, ...], bool]:
    """(kind, part, stages, input_grad_only) of a range name."""
    m = DUALPIPE_NAME.fullmatch(name)
    if m:
        if m.group("kind"):
            key = m.group("key")
            return m.group("kind"), None, (int(key.split()[1][1:]),), key.endswith("w=false")
        f, b = m.group("f"), m.group("b")
        return "FB", None, (int(f.split()[1][1:]), int(b.split()[1][1:])), b.endswith("w=false")
    m = PART_NAME.fullmatch(name)
    if m:
        return m.group("kind"), m.group("part"), (), False
    return None, None, (), False


def _phases(ranges: list[dict], events: Sequence[GpuEvent]) -> dict[str, PhaseTime]:
    host: dict[str, list[float]] = {}
    for e in sorted(ranges, key=lambda e: float(e["ts"])):
        host.setdefault(str(e["name"]), []).append(float(e["dur"]))
    gpu: dict[str, list[GpuEvent]] = {}
    for ev in events:
        gpu.setdefault(ev.phase, []).append(ev)
    out: dict[str, PhaseTime] = {}
    for name in [*host, *(n for n in gpu if n not in host)]:
        evs = gpu.get(name, [])
        by_stream: dict[int, float] = {}
        for ev in evs:
            by_stream[ev.stream] = by_stream.get(ev.stream, 0.0) + (ev.end - ev.start) / _US_PER_MS
        kind, part, stages, input_only = _name_parts(name)
        out[name] = PhaseTime(
            name, kind, part, stages, input_only, len(host.get(name, [])), sum(host.get(name, [])) / _US_PER_MS,
            sum(ev.end - ev.start for ev in evs if not ev.communication) / _US_PER_MS,
            sum(ev.end - ev.start for ev in evs if ev.communication) / _US_PER_MS,
            dict(sorted(by_stream.items())))
    return out


def _pair_ranges(ranges: list[dict]) -> list[tuple[_Range, tuple[str, ...]]]:
    """F&B pair ranges with the names nested in them (see :class:`PairTime`)."""
    placer = _Placer(ranges)
    found: list[tuple[_Range, tuple[str, ...]]] = []
    fallback: list[tuple[_Range, tuple[str, ...]]] = []
    for thread in placer.threads.values():
        for i, r in enumerate(thread):
            inner = []
            j = i + 1
            while j < len(thread) and thread[j].start < r.end:
                inner.append(j)
                j += 1
            names = tuple(thread[j].name for j in inner)
            kind = _name_parts(r.name)[0]
            if kind == "FB":
                found.append((r, names))
            elif kind is None:
                direct = {_name_parts(thread[j].name)[0] for j in inner if thread[j].parent == i}
                if {"F", "B"} <= direct:
                    fallback.append((r, names))
    return sorted(found or fallback, key=lambda p: p[0].start)


def _pairs(ranges: list[dict], pid: Any, events: Sequence[GpuEvent], compute: list[Span],
           origin: float) -> list[PairTime]:
    launched = sorted((ev for ev in events if ev.launch is not None), key=lambda ev: ev.launch)
    times = [ev.launch for ev in launched]
    out = []
    for r, names in _pair_ranges([e for e in ranges if e.get("pid") == pid]):
        mine = launched[bisect.bisect_left(times, r.start):bisect.bisect_right(times, r.end)]
        comm = union((ev.start, ev.end) for ev in mine if ev.communication)
        hidden = length(intersect(comm, compute))
        window = (max(ev.end for ev in mine) - min(ev.start for ev in mine)) if mine else 0.0
        out.append(PairTime(
            r.name, (r.start - origin) / _US_PER_MS, (r.end - r.start) / _US_PER_MS, window / _US_PER_MS,
            length(union((ev.start, ev.end) for ev in mine if not ev.communication)) / _US_PER_MS,
            length(comm) / _US_PER_MS, hidden / _US_PER_MS, (length(comm) - hidden) / _US_PER_MS, names))
    return out


def _streams(events: Sequence[GpuEvent]) -> list[StreamTime]:
    out = []
    for sid in sorted({ev.stream for ev in events}):
        evs = [ev for ev in events if ev.stream == sid]
        comp = length(union((ev.start, ev.end) for ev in evs if not ev.communication)) / _US_PER_MS
        comm = length(union((ev.start, ev.end) for ev in evs if ev.communication)) / _US_PER_MS
        busy = length(union((ev.start, ev.end) for ev in evs)) / _US_PER_MS
        out.append(StreamTime(sid, "communication" if comm > comp else "compute", busy, comp, comm, len(evs)))
    return out


def _rank_of(path: Path, meta: dict, position: int) -> tuple[int, int | None]:
    info = meta.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        world = info.get("world_size")
        return info["rank"], world if isinstance(world, int) else None
    m = _RANK_IN_NAME.search(path.name)
    return (int(m.group(1)) if m else position), None


def _device_of(e: dict) -> int:
    dev = e.get("args", {}).get("device", e.get("pid"))
    return int(dev) if isinstance(dev, (int, float)) or str(dev).isdigit() else 0


def _stream_of(e: dict) -> int:
    sid = e.get("args", {}).get("stream", e.get("tid"))
    if isinstance(sid, (int, float)) or str(sid).isdigit():
        return int(sid)
    m = re.search(r"\d+", str(sid))
    return int(m.group()) if m else 0


def profile_file(path: str | os.PathLike[str], position: int = 0) -> list[RankProfile]:
    """Every rank in one trace file: one per GPU with events, or one host-only profile.

    ``position`` numbers the file's rank when neither ``distributedInfo`` nor a
    ``rank-N`` file name says it.
    """
    p = Path(path)
    events, meta = read_events(p)
    complete = _complete(events, p)
    rank, world = _rank_of(p, meta, position)
    ranges = [e for e in complete if _cat(e) == _RANGE_CAT and not str(e.get("name", "")).startswith(_STEP_RANGE)]
    gpu = [e for e in complete if _cat(e) in _GPU_CATS]
    if not gpu:
        host = [e for e in complete if _cat(e) != "trace"]
        if not host:
            raise TraceError(f"{p}: no CPU or GPU events, only the profiler's own spans")
        origin = min(float(e["ts"]) for e in host)
        end = max(float(e["ts"]) + float(e["dur"]) for e in host)
        return [RankProfile(p, rank, world, None, False, origin, (end - origin) / _US_PER_MS, 0.0, 0.0, 0.0, 0.0,
                            [], _phases(ranges, ()), [], (), 0)]
    launches = {e["args"]["correlation"]: e for e in complete
                if _cat(e) in _LAUNCH_CATS and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    placer = _Placer(ranges)
    out = []
    for device in sorted({_device_of(e) for e in gpu}):
        linked: list[GpuEvent] = []
        launch_pid = None
        for e in sorted((e for e in gpu if _device_of(e) == device), key=lambda e: float(e["ts"])):
            call = launches.get(e.get("args", {}).get("correlation"))
            start = float(e["ts"])
            name = str(e.get("name", ""))
            if call is None:
                linked.append(GpuEvent(name, _stream_of(e), start, start + float(e["dur"]),
                                       bool(COMMUNICATION.search(name)), None, OUTSIDE))
                continue
            launch_pid = call.get("pid") if launch_pid is None else launch_pid
            t = float(call["ts"])
            linked.append(GpuEvent(name, _stream_of(e), start, start + float(e["dur"]),
                                   bool(COMMUNICATION.search(name)), t, placer.place(call.get("pid"), call.get("tid"), t)))
        comp = union((ev.start, ev.end) for ev in linked if not ev.communication)
        comm = union((ev.start, ev.end) for ev in linked if ev.communication)
        hidden = length(intersect(comm, comp))
        origin = linked[0].start
        end = max(ev.end for ev in linked)
        out.append(RankProfile(
            p, rank, world, device, True, origin, (end - origin) / _US_PER_MS, length(comp) / _US_PER_MS,
            length(comm) / _US_PER_MS, hidden / _US_PER_MS, (length(comm) - hidden) / _US_PER_MS,
            _streams(linked), _phases(ranges, linked), _pairs(ranges, launch_pid, linked, comp, origin),
            tuple(linked), sum(ev.launch is None for ev in linked)))
    return out


def trace_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files named, a directory standing for its ``*.json`` and ``*.json.gz`` files."""
    out: list[Path] = []
    for path in paths:
        p = Path(path)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith((".json", ".json.gz")))
            if not found:
                raise TraceError(f"{p}: no *.json or *.json.gz profiler traces in this directory")
            out.extend(found)
        elif not p.exists():
            raise TraceError(f"{p}: no such file")
        else:
            out.append(p)
    if not out:
        raise TraceError("no trace files given")
    return out


def read_profiles(paths: Iterable[str | os.PathLike[str]]) -> list[RankProfile]:
    """Every rank of the given PyTorch-profiler traces (files, or directories of them), by rank.

    Raises :class:`TraceError` naming the file and what is missing for anything
    that is not a readable Chrome trace with complete events.
    """
    profiles = [r for i, f in enumerate(trace_files(paths)) for r in profile_file(f, i)]
    return sorted(profiles, key=lambda r: (r.rank, -1 if r.device is None else r.device))


def exposed_spans(profile: RankProfile) -> list[Span]:
    """The rank's exposed communication as disjoint µs spans on the trace's clock (for figures)."""
    comp = union((ev.start, ev.end) for ev in profile.events if not ev.communication)
    comm = union((ev.start, ev.end) for ev in profile.events if ev.communication)
    return subtract(comm, comp)


__all__ = ["COMMUNICATION", "OUTSIDE", "GpuEvent", "PairTime", "PhaseTime", "RankProfile", "StreamTime",
           "exposed_spans", "profile_file", "read_events", "read_profiles", "trace_files"]
