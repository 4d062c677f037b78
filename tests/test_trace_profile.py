"""``trace profile`` on PyTorch-profiler Chrome traces with exactly known answers.

The synthetic traces have the structure of DeepSeek's published ``train.json``
(which has no licence, so it is not shipped): one CPU process with a main
thread holding the ranges and an autograd thread without any, launches as
``cuda_runtime`` events carrying the correlation id of the kernel they start,
kernels on three streams of GPU 0, DeepEP kernels named ``dpsk::ep::...``.
Times are given in ms and written in µs, as Kineto does.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dualpipe_megatron.runtime.profiler_ranges import op_range
from dualpipe_megatron.schedules.ir import B, F, Key, W
from dualpipe_megatron.trace import TraceError
from dualpipe_megatron.trace.cli import main
from dualpipe_megatron.trace.kineto import OUTSIDE, read_profiles
from dualpipe_megatron.trace.intervals import intersect, length, subtract, union

pytestmark = pytest.mark.unit

PID, MAIN, AUTOGRAD = 1166, 1166, 2571
COMPUTE, COMPUTE2, COMM = 7, 23, 27
GEMM = "void cutlass::device_kernel<dpsk::grouped_gemm::cuda::fp8_ptp128c::GemmKernel>(...)"
CAST = "void cuda::per_token_cast_to_fp8_with_channels<__nv_bfloat16, 128, false, 128, false>(...)"
DISPATCH = "void dpsk::ep::internode::dispatch<false, 8, true, 8>(int4*, float*, long*, ...)"
COMBINE = "void dpsk::ep::internode::combine<false, 8, __nv_bfloat16, 8, 2, 16, 24>(int4*, ...)"
NCCL = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


class Trace:
    """A Kineto-shaped trace built event by event; correlation ids count down, so linking cannot lean on order."""

    def __init__(self, distributed_rank: int | None = None) -> None:
        self.events: list[dict[str, Any]] = [
            {"name": "process_labels", "ph": "M", "pid": PID, "tid": 0, "args": {"labels": "CPU"}},
            {"name": "process_labels", "ph": "M", "pid": 0, "tid": 0, "args": {"labels": "GPU 0"}},
            *({"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stream {s} "}}
              for s in (COMPUTE, COMPUTE2, COMM)),
            {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans", "tid": "PyTorch Profiler",
             "ts": -5000.0, "dur": 1e6},
        ]
        self.meta: dict[str, Any] = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H800"}]}
        if distributed_rank is not None:
            self.meta["distributedInfo"] = {"backend": "nccl", "rank": distributed_rank, "world_size": 64}
        self.next_id = 90_000

    def range(self, name: str, start: float, end: float, tid: int = MAIN) -> None:
        self.events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": PID, "tid": tid,
                            "ts": start * 1e3, "dur": (end - start) * 1e3, "args": {"External id": self.next_id}})

    def kernel(self, name: str, stream: int, start: float, end: float, launch: float | None,
               tid: int = MAIN, cat: str = "kernel") -> None:
        """A GPU event over [start, end) ms, launched at ``launch`` ms from ``tid`` (None: launch not traced)."""
        self.next_id -= 1
        corr = self.next_id
        if launch is not None:
            call = "cudaMemcpyAsync" if cat == "gpu_memcpy" else "cudaLaunchKernel"
            self.events += [
                {"ph": "X", "cat": "cuda_runtime", "name": call, "pid": PID, "tid": tid, "ts": launch * 1e3,
                 "dur": 4.0, "args": {"External id": corr, "cbid": 211, "correlation": corr}},
                {"ph": "s", "id": corr, "pid": PID, "tid": tid, "ts": launch * 1e3, "cat": "ac2g", "name": "ac2g"},
                {"ph": "f", "id": corr, "pid": 0, "tid": stream, "ts": start * 1e3, "cat": "ac2g", "name": "ac2g",
                 "bp": "e"},
            ]
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start * 1e3,
                            "dur": (end - start) * 1e3,
                            "args": {"External id": corr, "device": 0, "context": 1, "stream": stream,
                                     "correlation": corr}})

    def write(self, path: Path) -> Path:
        text = json.dumps({**self.meta, "traceEvents": self.events})
        if path.name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
        return path


def test_interval_arithmetic() -> None:
    a = union([(5, 9), (0, 3), (2, 4), (9, 10), (12, 12)])
    assert a == [(0, 4), (5, 10)]
    b = [(1, 6), (8, 20)]
    assert intersect(a, b) == [(1, 4), (5, 6), (8, 10)]
    assert subtract(a, b) == [(0, 1), (6, 8)]
    assert length(intersect(a, b)) + length(subtract(a, b)) == length(a) == 9


def test_overlap_known_answer(tmp_path: Path) -> None:
    """Two compute streams and a communication stream: every total by hand."""
    t = Trace()
    t.range("attn(F)", 0, 60)
    t.kernel(GEMM, COMPUTE, 0, 10, launch=0.1)
    t.kernel(GEMM, COMPUTE, 20, 30, launch=0.2)
    t.kernel(GEMM, COMPUTE2, 5, 15, launch=0.3)
    t.kernel(DISPATCH, COMM, 8, 25, launch=0.4)
    t.kernel(NCCL, COMM, 40, 50, launch=0.5)
    t.kernel(CAST, COMM, 50, 52, launch=0.6)  # compute by its name, though on the communication stream
    [r] = read_profiles([t.write(tmp_path / "t.json")])
    assert r.gpu and r.unlinked == 0
    assert r.window_ms == pytest.approx(52)
    assert r.compute_ms == pytest.approx(10 + 15 + 2)  # [0,15) [20,30) [50,52)
    assert r.communication_ms == pytest.approx(17 + 10)  # [8,25) [40,50)
    assert r.hidden_communication_ms == pytest.approx(7 + 5)  # [8,15) [20,25)
    assert r.exposed_communication_ms == pytest.approx(27 - 12)
    assert r.exposed_share == pytest.approx(15 / 52)
    streams = {s.id: s for s in r.streams}
    assert (streams[COMPUTE].kind, streams[COMPUTE].busy_ms) == ("compute", pytest.approx(20))
    assert (streams[COMPUTE2].kind, streams[COMPUTE2].busy_ms) == ("compute", pytest.approx(10))
    assert streams[COMM].kind == "communication"
    assert (streams[COMM].busy_ms, streams[COMM].compute_ms, streams[COMM].communication_ms) == (
        pytest.approx(29), pytest.approx(2), pytest.approx(27))
    ph = r.phases["attn(F)"]
    assert (ph.compute_ms, ph.communication_ms) == (pytest.approx(32), pytest.approx(27))  # summed, not unions
    assert ph.by_stream == {COMPUTE: pytest.approx(20), COMPUTE2: pytest.approx(10), COMM: pytest.approx(29)}


def deepseek_shaped(t: Trace) -> None:
    """One F&B chunk pair of one layer, named and threaded like DeepSeek's train.json."""
    t.range("ProfilerStep#1", 0, 100)
    t.range("1F1B", 1, 99)
    t.range("attn(F)", 2, 10)
    t.range("dispatch(F)", 10, 12)
    t.range("attn(B)", 20, 40)
    t.range("mlp(W)", 40, 45)
    t.range("own range", 44, 46, tid=AUTOGRAD)
    t.kernel(GEMM, COMPUTE, 5, 9, launch=3)  # main thread, attn(F) inside 1F1B: the innermost wins
    t.kernel(CAST, COMM, 11, 12, launch=10.5)
    t.kernel(DISPATCH, COMM, 12, 20, launch=11)
    t.kernel(GEMM, COMPUTE, 26, 30, launch=25, tid=AUTOGRAD)  # placed by time into main's attn(B)
    t.kernel(GEMM, COMPUTE, 30, 34, launch=30, tid=AUTOGRAD)
    t.kernel(COMBINE, COMM, 31, 37, launch=30.5, tid=AUTOGRAD)
    t.kernel("Memcpy DtoD (Device -> Device)", COMPUTE, 16, 17, launch=15, tid=AUTOGRAD, cat="gpu_memcpy")
    t.kernel(GEMM, COMPUTE2, 41, 43, launch=41)
    t.kernel(GEMM, COMPUTE2, 44.5, 45, launch=44.5, tid=AUTOGRAD)  # the launching thread's own range first
    t.kernel(GEMM, COMPUTE, 0.6, 0.9, launch=0.5)  # under ProfilerStep only: no phase
    t.kernel(GEMM, COMPUTE, 50, 51, launch=None)  # launch not in the trace


def test_linking_and_phases_across_threads(tmp_path: Path) -> None:
    t = Trace(distributed_rank=3)
    deepseek_shaped(t)
    [r] = read_profiles([t.write(tmp_path / "train.json")])
    assert (r.rank, r.world_size, r.device, r.unlinked) == (3, 64, 0, 1)
    by_phase = {}
    for ev in r.events:
        by_phase.setdefault(ev.phase, []).append((ev.start, ev.stream))
    assert by_phase == {
        OUTSIDE: [(600.0, COMPUTE), (50_000.0, COMPUTE)],
        "attn(F)": [(5_000.0, COMPUTE)],
        "dispatch(F)": [(11_000.0, COMM), (12_000.0, COMM)],
        "1F1B": [(16_000.0, COMPUTE)],
        "attn(B)": [(26_000.0, COMPUTE), (30_000.0, COMPUTE), (31_000.0, COMM)],
        "mlp(W)": [(41_000.0, COMPUTE2)],
        "own range": [(44_500.0, COMPUTE2)],
    }
    ph = r.phases
    assert list(ph)[:2] == ["1F1B", "attn(F)"]  # ranges in start order, ProfilerStep left out
    assert "ProfilerStep#1" not in ph
    assert (ph["attn(F)"].kind, ph["attn(F)"].part, ph["attn(F)"].count) == ("F", "attn", 1)
    assert ph["attn(F)"].host_ms == pytest.approx(8)
    assert (ph["dispatch(F)"].compute_ms, ph["dispatch(F)"].communication_ms) == (pytest.approx(1), pytest.approx(8))
    assert (ph["attn(B)"].kind, ph["attn(B)"].compute_ms, ph["attn(B)"].communication_ms) == (
        "B", pytest.approx(8), pytest.approx(6))
    assert ph["attn(B)"].by_stream == {COMPUTE: pytest.approx(8), COMM: pytest.approx(6)}
    assert (ph["mlp(W)"].kind, ph["mlp(W)"].by_stream) == ("W", {COMPUTE2: pytest.approx(2)})
    assert ph["1F1B"].kind is None and ph["1F1B"].compute_ms == pytest.approx(1)
    assert ph[OUTSIDE].count == 0 and ph[OUTSIDE].compute_ms == pytest.approx(1.3)
    # 1F1B holds F and B passes directly: it is the F&B pair (no dualpipe FB ranges here).
    [pair] = r.pairs
    assert pair.name == "1F1B" and pair.phases[:2] == ("attn(F)", "dispatch(F)")
    assert pair.communication_ms == pytest.approx(8 + 6)  # [12,20) [31,37)
    assert pair.hidden_communication_ms == pytest.approx(1 + 3)  # [16,17) [31,34)
    assert pair.exposed_communication_ms == pytest.approx(10)
    assert r.exposed_communication_ms == pytest.approx(10)


def test_dualpipe_names_and_pairs(tmp_path: Path) -> None:
    """Our range names: pass, stages, w=false; a pair's communication hidden by a later op's compute."""
    t = Trace()
    t.range("step", 0, 100)  # holds F and B directly, but FB ranges exist, so it is no pair
    t.range("dualpipe F d0 s0 m0", 0, 5)
    t.range("dualpipe FB F(d0 s1 m3) B(d0 s0 m1 w=false)", 5, 50)
    t.range("dualpipe B d1 s2 m2 w=false", 50, 60)
    t.range("dualpipe W d0 s1 m2", 60, 70)
    t.kernel(GEMM, COMPUTE, 5, 25, launch=6)
    t.kernel(NCCL, COMM, 15, 35, launch=7, tid=AUTOGRAD)
    t.kernel(GEMM, COMPUTE, 30, 45, launch=55)  # the B's compute hides the pair's communication too
    t.kernel(GEMM, COMPUTE, 62, 64, launch=61)
    [r] = read_profiles([t.write(tmp_path / "ours.json")])
    ph = r.phases
    fb = ph["dualpipe FB F(d0 s1 m3) B(d0 s0 m1 w=false)"]
    assert (fb.kind, fb.part, fb.stages, fb.input_grad_only) == ("FB", None, (1, 0), True)
    assert (fb.compute_ms, fb.communication_ms) == (pytest.approx(20), pytest.approx(20))
    b = ph["dualpipe B d1 s2 m2 w=false"]
    assert (b.kind, b.stages, b.input_grad_only, b.compute_ms) == ("B", (2,), True, pytest.approx(15))
    assert (ph["dualpipe F d0 s0 m0"].kind, ph["dualpipe W d0 s1 m2"].input_grad_only) == ("F", False)
    [pair] = r.pairs
    assert pair.name == fb.name and pair.start_ms == pytest.approx(0)  # the window starts at the first kernel
    assert (pair.window_ms, pair.compute_ms, pair.communication_ms) == (
        pytest.approx(30), pytest.approx(20), pytest.approx(20))
    # [15,25) under the pair's own compute, [30,35) under the later B's, [25,30) exposed
    assert (pair.hidden_communication_ms, pair.exposed_communication_ms) == (pytest.approx(15), pytest.approx(5))


def test_gz_ranks_and_directories(tmp_path: Path) -> None:
    """Rank from distributedInfo, else from the file name; gzip by content; a directory stands for its traces."""
    for rank, name in ((1, "rank-1.json.gz"), (0, "rank-0.json")):
        t = Trace()
        t.range("attn(F)", 0, 10)
        t.kernel(GEMM, COMPUTE, 1, 3 + rank, launch=0.5)
        t.write(tmp_path / name)
    profiles = read_profiles([tmp_path])
    assert [(r.rank, r.path.name, r.window_ms) for r in profiles] == [
        (0, "rank-0.json", pytest.approx(2)), (1, "rank-1.json.gz", pytest.approx(3))]
    t = Trace(distributed_rank=7)
    t.kernel(GEMM, COMPUTE, 1, 2, launch=0.5)
    gz_named_json = tmp_path / "other" / "rank-0.json"
    gz_named_json.parent.mkdir()
    gz_named_json.write_bytes(gzip.compress(json.dumps({**t.meta, "traceEvents": t.events}).encode()))
    assert [r.rank for r in read_profiles([gz_named_json, tmp_path / "rank-1.json.gz"])] == [1, 7]


@pytest.mark.parametrize("content, missing", [
    (b"", "not JSON"),
    (b"rank0 step 1\n", "not JSON"),
    (b"\x1f\x8b\x08\x00garbage", "not a readable gzip file"),
    (b"42", "top level is a JSON int"),
    (b'{"schemaVersion": 1, "deviceProperties": []}', "no traceEvents key (top-level keys: deviceProperties"),
    (b'{"traceEvents": {"ph": "X"}}', "traceEvents is not a list"),
    (b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "no complete ('ph': 'X') events"),
    (b'{"traceEvents": [{"ph": "X", "name": "attn(F)", "ts": 1}]}', "'attn(F)' has no numeric ts/dur"),
])
def test_malformed_files_name_the_file_and_what_is_missing(tmp_path: Path, content: bytes, missing: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    with pytest.raises(TraceError) as err:
        read_profiles([bad])
    assert str(err.value).startswith(f"{bad}: ") and missing in str(err.value)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="nope.json: no such file"):
        read_profiles([tmp_path / "nope.json"])
    with pytest.raises(TraceError, match=r"no \*\.json or \*\.json\.gz profiler traces"):
        read_profiles([tmp_path])


def test_cli_text_json_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = Trace(distributed_rank=0)
    deepseek_shaped(t)
    trace = t.write(tmp_path / "train.json.gz")
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["profile", str(trace), "--json", str(out), "--figure", str(png)]) == 0
    text = capsys.readouterr().out
    assert "rank 0 of 64, GPU 0 (train.json.gz): 11 GPU events, 1 with no launch in the trace" in text
    assert "exposed 10.00 ms" in text and "F&B pairs" in text
    doc = json.loads(out.read_text())
    [rank] = doc["ranks"]
    assert {"window_ms", "compute_ms", "communication_ms", "hidden_communication_ms", "exposed_communication_ms",
            "streams", "phases", "pairs"} <= set(rank)
    assert rank["exposed_communication_ms"] == pytest.approx(10)
    assert {s["id"]: (s["kind"], s["busy_ms"]) for s in rank["streams"]}[COMM] == ("communication", pytest.approx(15))
    assert rank["phases"]["attn(B)"]["by_stream"] == {str(COMPUTE): 8.0, str(COMM): 6.0}
    assert rank["passes"]["B"]["communication_ms"] == pytest.approx(6)
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["profile", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {bad}: no traceEvents key (top-level keys: none); " \
                                              f"expected a PyTorch-profiler Chrome trace"


def test_real_cpu_profiler_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A torch.profiler trace of a tiny CPU training step with our op ranges, read end to end."""
    stages = [torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)]
    x = torch.randn(8, 16)
    k = lambda s, m: Key(0, s, m)  # noqa: E731
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with op_range((F(k(0, 0)),)):
            h = stages[0](x)
        with op_range((F(k(1, 0)),)):
            loss = stages[1](h).square().sum()
        with op_range((B(k(1, 0), w=False), )):
            loss.backward()
        with op_range((W(k(1, 0)),)):
            stages[1].weight.grad.mul_(0.5)
    path = tmp_path / "rank-0.json"
    prof.export_chrome_trace(str(path))
    [r] = read_profiles([path])
    assert not r.gpu and r.streams == [] and r.compute_ms == 0 and r.window_ms > 0
    names = ["dualpipe F d0 s0 m0", "dualpipe F d0 s1 m0", "dualpipe B d0 s1 m0 w=false", "dualpipe W d0 s1 m0"]
    assert list(r.phases) == names
    assert [(p.kind, p.stages, p.count) for p in r.phases.values()] == [
        ("F", (0,), 1), ("F", (1,), 1), ("B", (1,), 1), ("W", (1,), 1)]
    assert r.phases[names[2]].input_grad_only and all(0 < p.host_ms < r.window_ms for p in r.phases.values())
    assert main(["profile", str(path)]) == 0
    assert "no GPU events (a CPU run), so host-side range times only" in capsys.readouterr().out
