"""The schedule CLI: outputs, and one-line errors with exit status 2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dualpipe_megatron.schedules.cli import main, make_parser

pytestmark = pytest.mark.multiprocess


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dualpipe_megatron.schedules", *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv,fragment", [
    (["dump", "--schedule", "dualpipe", "-P", "3", "-M", "12"], "even number of ranks"),
    (["dump", "--schedule", "dualpipev", "-P", "4", "-M", "7"], "microbatches >= 2*ranks (8)"),
    (["dump", "--schedule", "zigzag", "-P", "4", "-M", "8"], "unknown schedule 'zigzag'"),
    (["simulate", "--schedule", "1f1b", "-P", "4", "-M", "8", "--F", "0"], "cost F must be positive"),
    (["simulate", "--schedule", "1f1b", "-P", "4", "-M", "8", "--W", "x"], "bad cost value"),
    (["compare", "-P", "0", "-M", "8"], "expected a positive integer"),
    (["draw", "--schedule", "1f1b", "-P", "2", "-M", "4", "-o", "x.pdf"], "use a .png or .svg"),
    ([], "required: command"),
])
def test_bad_input_is_one_line_and_status_2(argv: list[str], fragment: str) -> None:
    proc = run(*argv)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_help_for_each_subcommand() -> None:
    """Each subcommand's --help exits 0, and its parser (not the help text) takes --ranks."""
    subparsers = next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for sub in ("dump", "simulate", "compare", "draw"):
        options = {o for action in subparsers.choices[sub]._actions for o in action.option_strings}
        assert (run(sub, "--help").returncode, "--ranks" in options) == (0, True), sub


def test_simulate_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "dualpipev", "-P", "4", "-M", "10", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["max_bubble"] == "6" and doc["peak_activations"] == 9 and doc["devices"] == 4
    assert main(["simulate", "--schedule", "1f1b", "-P", "2", "-M", "4"]) == 0
    out = capsys.readouterr().out
    assert "max bubble=3" in out and "| rank |" in out


def test_compare_lists_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-P", "4", "-M", "16", "--W", "0.8", "--FB", "2.5"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| schedule")}
    assert list(rows) == ["1f1b", "interleaved", "zb1p", "zbv", "vhalf", "chimera", "dualpipe", "dualpipev"]
    # V-Half's trade-off against ZB-V on the same V: fewer live activations, a longer step.
    assert int(rows["vhalf"][5]) < int(rows["zbv"][5]) and float(rows["vhalf"][1]) > float(rows["zbv"][1])
    assert main(["compare", "-P", "4", "-M", "10"]) == 0
    assert "n/a: interleaved" in capsys.readouterr().out


def test_compare_interleaved_with_more_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-P", "4", "-M", "16", "--chunks", "2,4"]) == 0
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| interleaved")}
    assert set(rows) == {"interleaved-2", "interleaved-4"}
    assert rows["interleaved-4"][0].strip() == "16" and rows["interleaved-2"][0].strip() == "8"
    assert float(rows["interleaved-4"][1]) < float(rows["interleaved-2"][1])  # smaller bubble


def test_draw_writes_png(tmp_path: Path) -> None:
    out = tmp_path / "v.png"
    proc = run("draw", "--schedule", "dualpipev", "-P", "4", "-M", "10", "--timed", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
