"""Trace files, merge, analysis and drawing on synthetic runs with exactly known times.

Each rank's ops are fed to the recorder at the simulator's times (1 cost unit
= 1 ms), with a receive wait filling every gap before an op; the analysis must
then measure the simulator's own bubbles and recover its costs.
"""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from dualpipe_megatron.runtime.plan import executed_halves
from dualpipe_megatron.schedules import Costs, Schedule, build_schedule, simulate
from dualpipe_megatron.schedules.ir import halves
from dualpipe_megatron.schedules.simulate import SimResult, StageCost, StageCosts
from dualpipe_megatron.trace import OpTracer, TraceError, analyze, chrome_trace, load
from dualpipe_megatron.trace.cli import main
from dualpipe_megatron.trace.figure import draw_measured
from dualpipe_megatron.trace.records import pipelines

pytestmark = pytest.mark.unit

NS_PER_MS = 1_000_000
COSTS = Costs.of(F=1, B=2, W="0.5", FB="2.5")
OP_NAME = re.compile(r"^[FBW] m\d+ s\d+( d1)?( \+ B m\d+ s\d+( d1)?)?$")


def _ns(t: Fraction) -> int:
    return int(t * NS_PER_MS)


def synthetic_run(directory: Path, sched: Schedule, steps: int = 3, forward_only_step: int | None = None,
                  costs: Costs | StageCosts = COSTS) -> SimResult:
    """``steps`` steps of ``sched`` recorded at simulated times, 10 makespans apart."""
    res = simulate(sched, costs)
    now = [0]
    pipeline = list(range(sched.ranks))
    tracers = [OpTracer(directory, r, pipeline, clock=lambda: now[0]) for r in pipeline]
    for k in range(steps):
        base = 10 * k * _ns(res.makespan)
        forward_only = k == forward_only_step
        for r, tracer in enumerate(tracers):
            now[0] = base
            tracer.step_begun(sched, forward_only)
            prev = base
            for i, op in enumerate(sched.ops[r]):
                parts = executed_halves(op, forward_only)
                if not parts:
                    continue
                start, end = base + _ns(res.start[r][i]), base + _ns(res.end[r][i])
                if forward_only:
                    end = start + _ns(COSTS.F)
                tracer.op_done(i, parts, prev, end, start - prev)
                prev = end
            now[0] = base + _ns(res.makespan)
            tracer.step_done()
    for tracer in tracers:
        tracer.close()
    return res


@pytest.mark.parametrize(("name", "ranks", "microbatches"), [("dualpipev", 2, 4), ("dualpipev", 4, 10),
                                                            ("dualpipe", 4, 8), ("zb1p", 3, 6)])
def test_measured_bubbles_and_costs_match_the_simulation(tmp_path: Path, name: str, ranks: int,
                                                         microbatches: int) -> None:
    sched = build_schedule(name, ranks, microbatches)
    res = synthetic_run(tmp_path, sched)
    (report,) = analyze(load(tmp_path), skip=1)
    assert len(report.steps) == 2 and report.skipped == 1
    assert report.schedule.ops == sched.ops and report.schedule.placement == sched.placement
    # Each tracer maps its clock to the wall clock separately: allow a few µs between ranks.
    for step in report.steps:
        assert step.makespan == pytest.approx(float(res.makespan), abs=0.05)
        assert step.bubble == pytest.approx([float(r.bubble) for r in res.per_rank], abs=0.05)
        assert step.bubble_ratio == pytest.approx(float(res.bubble_ratio), abs=1e-3)
        # Every gap was a receive wait, so waits are the bubble less the tail after a rank's last op.
        tails = [float(res.makespan - max(ends)) for ends in res.end]
        assert [w + t for w, t in zip(step.wait, tails)] == pytest.approx(step.bubble, abs=0.05)
    assert report.costs.F == COSTS.F and report.costs.B == COSTS.B
    if any(not h.w for _, _, op in sched.iter_ops() for h in halves(op) if hasattr(h, "w")):
        assert report.costs.W == COSTS.W
    assert report.prediction.makespan == res.makespan
    assert report.predicted_ratio == pytest.approx(report.measured_ratio, abs=1e-3)


@pytest.mark.parametrize(("name", "ranks", "microbatches"), [("dualpipev", 4, 10), ("dualpipe", 4, 8)])
def test_costs_command_recovers_per_stage_costs(tmp_path: Path, name: str, ranks: int, microbatches: int,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Unequal stages (seeded factors in [0.7, 1.3], W = 0.4 B, F&B ratio 0.9), traced at simulated
    times: ``costs`` writes them back and its file simulates the same step."""
    import random

    sched = build_schedule(name, ranks, microbatches)
    rng = random.Random(7)
    truth = StageCosts({k: StageCost(Fraction(f), 2 * Fraction(f), Fraction(4, 5) * Fraction(f))
                        for k in sorted(sched.placement)
                        for f in [Fraction(round(rng.uniform(0.7, 1.3), 3)).limit_denominator(1000)]},
                       fb_ratio=Fraction(9, 10))
    res = synthetic_run(tmp_path / "trace", sched, costs=truth)
    out = tmp_path / "stage_costs.json"
    assert main(["costs", str(tmp_path / "trace"), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    got = StageCosts.from_json_obj(json.loads(out.read_text()))
    assert sorted(got.stages) == sorted(truth.stages)
    for key, cost in truth.stages.items():
        for part in ("F", "B", "W"):
            assert float(getattr(got.stages[key], part)) == pytest.approx(float(getattr(cost, part)), abs=1e-5), key
    assert float(got.fb_ratio) == pytest.approx(0.9, abs=1e-4)
    assert float(simulate(sched, got).makespan) == pytest.approx(float(res.makespan), rel=1e-4)


def test_chrome_trace_has_one_track_per_rank_and_named_ops(tmp_path: Path) -> None:
    sched = build_schedule("dualpipe", 4, 8)
    synthetic_run(tmp_path, sched, steps=2)
    trace = json.loads(json.dumps(chrome_trace(load(tmp_path))))
    events = trace["traceEvents"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(threads) == [(0, r) for r in range(4)]
    spans = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in spans} == set(threads)
    ops = [e for e in spans if e["cat"] not in ("step", "p2p wait")]
    assert len(ops) == 2 * sum(len(r) for r in sched.ops)
    assert all(OP_NAME.match(e["name"]) for e in ops), {e["name"] for e in ops if not OP_NAME.match(e["name"])}
    assert any(e["name"].endswith(" d1") for e in ops)
    single = next(e for e in ops if e["cat"] == "F")
    assert {"d", "s", "m", "step", "wait_us"} <= set(single["args"])
    assert any(e["cat"] == "p2p wait" for e in spans)
    # Ops nest inside their step on their own track, and never overlap there.
    for key in threads:
        track = sorted((e for e in spans if (e["pid"], e["tid"]) == key and e["cat"] != "step"),
                       key=lambda e: e["ts"])
        steps = [e for e in spans if (e["pid"], e["tid"]) == key and e["cat"] == "step"]
        for a, b in zip(track, track[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
        for e in track:
            assert any(s["ts"] - 1e-6 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-6 for s in steps)


def test_forward_only_steps_are_traced_but_not_analysed(tmp_path: Path) -> None:
    sched = build_schedule("dualpipev", 2, 4)
    synthetic_run(tmp_path, sched, steps=4, forward_only_step=2)
    traces = load(tmp_path)
    assert [s.forward_only for s in traces[0].steps] == [False, False, True, False]
    (report,) = analyze(traces, skip=1)
    assert [s.step for s in report.steps] == [1, 3]
    names = {e["name"] for e in chrome_trace(traces)["traceEvents"] if e.get("args", {}).get("step") == 2}
    assert names and all(n.startswith("F ") or n == "p2p wait" for n in names)


def test_cli_merge_analyze_draw(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synthetic_run(tmp_path, build_schedule("dualpipev", 2, 4))
    assert main(["merge", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert main(["analyze", str(tmp_path), "--per-step"]) == 0
    out = capsys.readouterr().out
    assert "measured" in out and "predicted" in out and "step 2:" in out
    assert main(["analyze", str(tmp_path), "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["measured"]["bubble_ratio"] == pytest.approx(summary["predicted"]["bubble_ratio"], abs=1e-3)
    assert main(["draw", str(tmp_path), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
    assert main(["draw", str(tmp_path), "-o", str(tmp_path / "t.png"), "--step", "0"]) == 2
    assert "not an analysed training step" in capsys.readouterr().err


def test_draw_measured_svg(tmp_path: Path) -> None:
    synthetic_run(tmp_path, build_schedule("dualpipe", 2, 4))
    traces = load(tmp_path)
    (report,) = analyze(traces)
    assert draw_measured(pipelines(traces)[0], report, tmp_path / "t.svg", step=2) == 2
    assert "measured, step 2" in (tmp_path / "t.svg").read_text()


def test_bad_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(tmp_path)]) == 2
    assert "no rank*.jsonl" in capsys.readouterr().err
    synthetic_run(tmp_path, build_schedule("dualpipev", 2, 4))
    # A crash can cut the last line short: it is dropped, the rest still reads.
    with (tmp_path / "rank1.jsonl").open("a") as f:
        f.write('{"step": 3, "ops": [')
    assert len(load(tmp_path)[1].steps) == 3
    # Another run's file in the same directory is refused.
    (tmp_path / "rank2.jsonl").write_text((tmp_path / "rank0.jsonl").read_text().replace(
        '"global_rank": 0, "world_size": 2', '"global_rank": 2, "world_size": 3'))
    with pytest.raises(TraceError, match="exactly one run"):
        load(tmp_path)
    (tmp_path / "rank2.jsonl").write_text("not json\n")
    with pytest.raises(TraceError, match="not a trace file"):
        load(tmp_path)


def test_too_few_steps(tmp_path: Path) -> None:
    synthetic_run(tmp_path, build_schedule("dualpipev", 2, 4), steps=1)
    with pytest.raises(TraceError, match="none left after skipping 1"):
        analyze(load(tmp_path))
