"""The projection's DualPipeV rows under activation budgets (``project --budgets``): fast, no launch."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from dualpipe_megatron.projection.cli import main
from dualpipe_megatron.projection.costs import StageTimes
from dualpipe_megatron.projection.count import ChunkCount
from dualpipe_megatron.projection.placement import Uniform
from dualpipe_megatron.projection.project import activation_budget, build_variant, project, project_order, variants
from dualpipe_megatron.projection.report import GIB, rows
from dualpipe_megatron.schedules import build_schedule
from dualpipe_megatron.schedules.optimize import optimize_order

pytestmark = pytest.mark.slow

BUDGETS = (Fraction(1), Fraction(3, 4), Fraction(1, 2), Fraction(1, 10))


def test_budget_is_a_fraction_of_deepseeks_peak_raised_to_the_minimum() -> None:
    sched = build_schedule("dualpipev", 3, 6)  # DeepSeek's order peaks at 2P+1 = 7 on every rank
    assert [activation_budget(sched, b) for b in BUDGETS] == [(7, False), (6, False), (4, False), (2, True)]


def test_budget_rows_stay_within_their_budget_and_report_gib() -> None:
    t = StageTimes(F=1, B=2, W=0.5, FB=2.5, a2a_fwd=0.2, a2a_bwd=0.2, p2p=0.01, source="test")
    wanted = [v for v in variants(budgets=BUDGETS[:3]) if v.label.startswith("dualpipev")]
    assert [v.label for v in wanted] == ["dualpipev", "dualpipev+opt"] + [
        f"dualpipev+opt budget {b}" for b in ("1", "3/4", "1/2")]
    results = project(Uniform(t, 0.1, 3), 3, 6, wanted)
    chunk = ChunkCount(F=1, B=2, B_input=1, W=1, saved_bytes=3 * GIB, params=10**9)  # 3 GiB per 1/P stage
    table = {r["schedule"]: r for r in rows(results, chunk, 1.0)}
    deepseek = table["dualpipev"]
    assert deepseek["max_activations"] is None and deepseek["peak_live_activations"] == 7
    for b, k in zip(BUDGETS[:3], (7, 6, 4)):
        row = table[f"dualpipev+opt budget {b}"]
        assert row["max_activations"] == k and not row["budget_clamped"]
        assert row["peak_live_activations"] <= k
        # Uniform stages: each live (d,s,m) is half a 1/P stage, so the GiB are the units' bytes.
        assert row["peak_activations_stages"] == row["peak_live_activations"] / 2
        assert row["peak_activations_gib"] == 3 * row["peak_activations_stages"]
    assert table["dualpipev+opt budget 1"]["step_ms"] <= deepseek["step_ms"]  # DeepSeek's order fits K


def test_a_given_order_projects_as_its_row() -> None:
    """``project_order`` on the order a budget row builds (what the launch plan passes: the job's
    own order) gives that row's projection; on DeepSeek's order, the plain row's."""
    t = StageTimes(F=1, B=2, W=0.5, FB=2.5, a2a_fwd=0.2, a2a_bwd=0.2, p2p=0.01, source="test")
    placement = Uniform(t, 0.1, 3)
    plain, budgeted = (next(v for v in variants(budgets=[Fraction(1, 2)]) if v.label == label)
                       for label in ("dualpipev", "dualpipev+opt budget 1/2"))
    deepseek = build_variant(plain, 3, 6)
    costs = placement.plan(deepseek, plain.overlap, plain.auto_layout).costs
    order = optimize_order(deepseek, costs, max_activations=4)
    assert project_order(placement, budgeted, order, 4) == project(placement, 3, 6, [budgeted])[0]
    assert project_order(placement, plain, deepseek) == project(placement, 3, 6, [plain])[0]


def test_cli_budget_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "proj.json"
    assert main(["project", "-P", "3", "-M", "6", "--layers-per-rank", "1", "--chunks", "2",
                 "--budgets", "1,0.75,0.1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| dualpipev+opt budget 3/4 (K=6) |" in text
    assert "| dualpipev+opt budget 1/10 (K=2, raised to the minimum) |" in text
    assert "peak live (d,s,m)" in text and "Budget rows" in text
    got = {r["schedule"]: r for r in json.loads(out.read_text())["rows"] if r["schedule"]}
    assert got["dualpipev+opt budget 1"]["max_activations"] == 7
    assert got["vhalf"]["peak_live_activations"] == 4 < got["zbv"]["peak_live_activations"] == 6


@pytest.mark.parametrize("text,fragment", [("0", "budgets must be positive"), ("x", "expected fractions"),
                                           ("1,", "expected fractions")])
def test_bad_budgets_are_one_line(text: str, fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["project", "--budgets", text]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err
