"""The EPLB CLI prints the planner's placement and the guard's predicted loads; bad input is
one ``error:`` line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dualpipe_megatron.eplb import imbalance, rebalance_experts
from dualpipe_megatron.eplb.cli import main
from dualpipe_megatron.eplb.stats import LoadStats

pytestmark = pytest.mark.multiprocess

# Two iterations of 2 MoE layers (global numbers 3 and 7) x 8 experts; averages:
# layer 3: [90, 10, 10, 10, 40, 10, 30, 20] (220 tokens), layer 7: [5]*7 + [125] (160 tokens).
HISTORY = [[[100, 10, 10, 10, 50, 10, 30, 20], [5] * 7 + [125]],
           [[80, 10, 10, 10, 30, 10, 30, 20], [5] * 7 + [125]]]
# The file's placement over 4 EP ranks: GPU loads layer 3 [130, 50, 20, 20], layer 7 [10, 10, 10, 130].
PLACEMENT = [[0, 4, 6, 7, 1, 2, 3, 5], [0, 1, 2, 3, 4, 5, 6, 7]]


def write(path: Path, placement: list | None = PLACEMENT, ep_size: int | None = 4,
          history: list = HISTORY) -> Path:
    stats = LoadStats([3, 7], 8, window=4)
    for counts in history:
        stats.add(torch.tensor(counts, dtype=torch.float64))
    stats.save(path, iteration=42, placement=None if placement is None else torch.tensor(placement),
               ep_size=ep_size)
    return path


def load() -> torch.Tensor:
    return torch.tensor(HISTORY, dtype=torch.float64).mean(dim=0)


def plan_args(path: Path, replicas: int, *extra: str) -> list[str]:
    return ["plan", "--stats", str(path), "--replicas", str(replicas), "--groups", "2",
            "--nodes", "1", "--gpus", "4", *extra]


def test_plan_prints_the_planners_placement_and_loads_before_and_after(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = write(tmp_path / "s.json"), tmp_path / "plan.json"
    assert main(plan_args(path, 8, "--json", str(out))) == 0
    text = capsys.readouterr().out
    phy2log, log2phy, logcnt = rebalance_experts(load(), 8, 2, 1, 4)
    for row in phy2log.tolist():
        assert " | ".join(f"GPU {g}: {row[2 * g]} {row[2 * g + 1]}" for g in range(4)) in text
    after = [[sum(load()[i, e].item() for e in row[2 * g:2 * g + 2]) for g in range(4)]
             for i, row in enumerate(phy2log.tolist())]
    after_step = sum(map(max, after)) / sum(sum(r) / 4 for r in after)
    assert after_step == pytest.approx(imbalance((phy2log, log2phy, logcnt), load(), 4))
    assert "before = the file's placement" in text
    assert "GPU load before: 130.0 50.0 20.0 20.0 (max/mean 2.364)" in text
    assert "GPU load before: 10.0 10.0 10.0 130.0 (max/mean 3.250)" in text
    assert f"(sum of layer maxima / sum of layer means): 2.737 -> {after_step:.3f}\n" in text
    assert after_step < 2.7
    doc = json.loads(out.read_text())
    assert [doc["phy2log"], doc["log2phy"], doc["logcnt"]] == [t.tolist() for t in (phy2log, log2phy, logcnt)]
    assert doc["gpu_load_before"] == [[130, 50, 20, 20], [10, 10, 10, 130]]
    assert doc["gpu_load_after"] == after  # integer loads: exact sums
    assert doc["imbalance_before"] == pytest.approx(260 / 95) and doc["layers"] == [3, 7]


def test_plan_with_extra_replicas_lists_them_and_has_no_before(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(plan_args(write(tmp_path / "s.json"), 12)) == 0
    text = capsys.readouterr().out
    plan = rebalance_experts(load(), 12, 2, 1, 4)
    for counts in plan[2].tolist():
        extra = ", ".join(f"expert {e} x{n}" for e, n in enumerate(counts) if n > 1)
        assert f"  replicas: {extra}\n" in text
    assert "before = n/a (no placement with 12 slots)" in text and "GPU load before: n/a" in text
    assert f"n/a -> {imbalance(plan, load(), 4):.3f}" in text
    assert "layer 3:" in text and "layer 7:" in text


def test_plan_without_placement_starts_from_identity(tmp_path: Path, capsys) -> None:
    assert main(plan_args(write(tmp_path / "s.json", placement=None), 8)) == 0
    text = capsys.readouterr().out
    assert "before = identity" in text and "GPU load before: 100.0 20.0 50.0 50.0 (max/mean 1.818)" in text


def test_stats_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", str(write(tmp_path / "s.json"))]) == 0
    text = capsys.readouterr().out
    assert "iteration 42, window 4 (2 iterations recorded), 2 MoE layers x 8 experts, ep_size 4" in text
    assert "EP ranks: 4, placement: the file's placement" in text
    assert ("layer 3: 220.0 routed tokens/iteration; hottest experts 0 (40.9%), 4 (18.2%), 6 (13.6%); "
            "max/mean over experts 3.273; max/mean over EP ranks 2.364") in text
    assert ("layer 7: 160.0 routed tokens/iteration; hottest experts 7 (78.1%), 0 (3.1%), 1 (3.1%); "
            "max/mean over experts 6.250; max/mean over EP ranks 3.250") in text
    assert "step max/mean over EP ranks: 2.737" in text
    assert main(["stats", str(write(tmp_path / "n.json", placement=None, ep_size=None))]) == 0
    text = capsys.readouterr().out
    assert "max/mean over experts 6.250\n" in text and "EP ranks" not in text


def _edit(key: str, value: object):
    def edit(obj: dict) -> dict:
        return {**obj, key: value}
    return edit


@pytest.mark.parametrize("argv,edit,fragment", [
    (["stats", "{missing}"], None, "cannot read"),
    (["stats", "{path}"], "{", "is not JSON"),
    (["stats", "{path}"], "[1, 2]", "not an EPLB stats file (format 'list'"),
    (["stats", "{path}"], _edit("format", "other/1"), "not an EPLB stats file"),
    (["stats", "{path}"], _edit("history", []), "empty history"),
    (["stats", "{path}"], _edit("load", [[1.0] * 8]),
     "load has shape [1, 8], expected [layers, num_experts] = [2, 8]"),
    (["stats", "{path}"], _edit("load", None), "load is not a table of numbers"),
    (["stats", "{path}"], _edit("placement", [[0] * 8, list(range(8))]),
     "placement leaves an expert without a slot"),
    (["stats", "{path}"], _edit("placement", [list(range(9))] * 2), "expert id outside 0..7"),
    (["stats", "{path}"], _edit("ep_size", 3), "ep_size 3 must be a positive divisor of the 8 slots"),
    (["plan", "--stats", "{path}", "--replicas", "10", "--groups", "2", "--nodes", "1", "--gpus", "4"],
     None, "num_gpus (4) must divide num_replicas (10)"),
    (["plan", "--stats", "{path}", "--replicas", "6", "--groups", "2", "--nodes", "1", "--gpus", "2"],
     None, "num_replicas (6) must be >= the number of logical experts (8)"),
    (["plan", "--stats", "{path}", "--replicas", "8", "--groups", "3", "--nodes", "1", "--gpus", "4"],
     None, "num_groups (3) must divide the number of logical experts (8)"),
    (["plan", "--stats", "{path}", "--replicas", "8", "--groups", "2", "--nodes", "3", "--gpus", "4"],
     None, "num_nodes (3) must divide num_gpus (4)"),
    (["plan", "--stats", "{path}", "--replicas", "0", "--groups", "2", "--nodes", "1", "--gpus", "4"],
     None, "expected a positive integer, got 0"),
    (["plan", "--replicas", "8", "--groups", "2", "--nodes", "1", "--gpus", "4"], None, "required: --stats"),
    (["plan", "--stats", "{path}", "--replicas", "8", "--groups", "2", "--nodes", "1", "--gpus", "4",
      "--json", "{missing}/out.json"], None, "cannot write"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], edit, fragment: str) -> None:
    path = write(tmp_path / "s.json")
    if isinstance(edit, str):
        path.write_text(edit)
    elif edit is not None:
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    argv = [a.format(path=path, missing=tmp_path / "nope") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and fragment in err, err


def test_module_entry_point_runs_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = plan_args(write(tmp_path / "s.json"), 12)
    proc = subprocess.run([sys.executable, "-m", "dualpipe_megatron.eplb", *argv],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert main(argv) == 0
    assert proc.stdout == capsys.readouterr().out and "layer 7:" in proc.stdout


def test_plan_shows_each_node_and_its_groups_under_the_hierarchical_policy(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "s.json")
    assert main(["plan", "--stats", str(path), "--replicas", "12", "--groups", "2", "--nodes", "2",
                 "--gpus", "4"]) == 0
    text = capsys.readouterr().out
    assert "nodes 2, GPUs 4, hierarchical policy" in text
    phy2log = rebalance_experts(load(), 12, 2, 2, 4)[0]
    for row in phy2log.tolist():
        for node in range(2):
            slots = row[6 * node:6 * (node + 1)]
            [group] = {e // 4 for e in slots}  # the node holds one whole group, copies included
            gpus = " | ".join(f"GPU {2 * node + g}: " + " ".join(map(str, slots[3 * g:3 * g + 3])) for g in range(2))
            assert f"  node {node} (groups {group}): {gpus}\n" in text, text
