"""Per-stage costs (``--stage-costs``): a uniform file simulates exactly as the uniform costs do,
unequal stages change the timing where they should, and bad files are refused in one line."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.cli import main
from dualpipe_megatron.schedules.ir import FB, B, F, Key, ScheduleError
from dualpipe_megatron.schedules.simulate import Costs, StageCost, StageCosts, simulate

pytestmark = pytest.mark.unit

UNIFORM = Costs.of(F=1, B=2, W=1, FB=3, c="0.1")


@pytest.mark.parametrize(("name", "ranks", "microbatches"), [
    ("dualpipev", 2, 4), ("dualpipev", 4, 20), ("dualpipe", 4, 20), ("dualpipe", 8, 16), ("1f1b", 4, 8),
    ("interleaved", 4, 8), ("zb1p", 4, 8),
])
def test_uniform_stage_costs_equal_uniform_costs_exactly(name: str, ranks: int, microbatches: int) -> None:
    sched = build_schedule(name, ranks, microbatches)
    plain = simulate(sched, UNIFORM)
    staged = simulate(sched, StageCosts.from_json_obj(StageCosts.uniform(sched, UNIFORM).to_json_obj()))
    assert (staged.makespan, staged.start, staged.end) == (plain.makespan, plain.start, plain.end)


def test_pair_cost_follows_its_two_stages() -> None:
    costs = StageCosts({(0, 0): StageCost(Fraction(1), Fraction(2), Fraction(1, 2)),
                        (0, 1): StageCost(Fraction(3), Fraction(5), Fraction(2))}, fb_ratio=Fraction(4, 5))
    f, b = F(Key(0, 1, 0)), B(Key(0, 0, 1), w=False)
    assert costs.duration(FB(f, b)) == Fraction(4, 5) * (3 + 2) - Fraction(1, 2)
    assert costs.duration(FB(f, B(Key(0, 0, 1)))) == Fraction(4)
    assert costs.duration(b) == Fraction(3, 2) and costs.duration(f) == 3


def test_a_heavier_stage_lengthens_the_step() -> None:
    sched = build_schedule("dualpipev", 4, 16)
    base = StageCosts.uniform(sched, UNIFORM)
    heavy = StageCosts({**base.stages, (0, 7): StageCost(Fraction(2), Fraction(4), Fraction(2))},
                       base.fb_ratio, base.c)
    assert simulate(sched, heavy).makespan > simulate(sched, base).makespan


def _write(path: Path, obj: object) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def test_cli_simulates_and_compares_with_a_stage_cost_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sched = build_schedule("dualpipev", 2, 8)
    path = _write(tmp_path / "costs.json", StageCosts.uniform(sched, UNIFORM).to_json_obj())
    assert main(["simulate", "--schedule", "dualpipev", "-P", "2", "-M", "8", "--json", "--stage-costs", path]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert main(["simulate", "--schedule", "dualpipev", "-P", "2", "-M", "8", "--json", "--c", "0.1"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert staged["makespan"] == plain["makespan"] and staged["costs"]["fb_ratio"] == 1.0
    assert main(["compare", "-P", "2", "-M", "8", "--stage-costs", path]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert "n/a: stage costs are for 4" in rows["dualpipe"] and "n/a" in rows["1f1b"]
    assert "n/a" not in rows["dualpipev"] and "n/a" not in rows["interleaved"]


@pytest.mark.parametrize("content, message", [
    ([1, 2], "expected {"),
    ({"stages": []}, "expected {"),
    ({"stages": [{"d": 0, "s": 0, "F": 1, "B": 2}]}, "bad entry"),
    ({"stages": [{"d": 0, "s": 0, "F": 1, "B": 2, "W": 2}]}, "0 <= W < B"),
    ({"stages": [{"d": 0, "s": 0, "F": 1, "B": 2, "W": 1}] * 2}, "given twice"),
    ({"fb_ratio": 0, "stages": [{"d": 0, "s": 0, "F": 1, "B": 2, "W": 1}]}, "fb_ratio must be > 0"),
    ({"stages": [{"d": 0, "s": 0, "F": 1, "B": 2, "W": 1}]}, "stage costs are for 1"),
])
def test_bad_stage_cost_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: object,
                                     message: str) -> None:
    path = _write(tmp_path / "bad.json", content)
    assert main(["simulate", "--schedule", "dualpipev", "-P", "2", "-M", "8", "--stage-costs", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "dualpipev", "-P", "2", "-M", "8", "--stage-costs",
                 str(tmp_path / "missing.json")]) == 2
    assert "cannot read stage costs" in capsys.readouterr().err


def test_a_negative_forward_cost_is_refused() -> None:
    with pytest.raises(ScheduleError):
        StageCosts.from_json_obj({"stages": [{"d": 0, "s": 0, "F": -1, "B": 2, "W": 1}]})
