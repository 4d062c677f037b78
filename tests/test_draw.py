"""The drawer writes real PNG/SVG files for every schedule family and rejects other formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpipe_megatron.schedules.draw import draw_schedule
from dualpipe_megatron.schedules.ir import ScheduleError
from dualpipe_megatron.schedules.registry import build_schedule
from dualpipe_megatron.schedules.simulate import Costs, simulate

pytestmark = pytest.mark.unit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("simulated", [False, True], ids=["slots", "simulated"])
def test_dualpipev_png(tmp_path: Path, simulated: bool) -> None:
    sched = build_schedule("dualpipev", 4, 10)
    result = simulate(sched, Costs.of(1, 2, 1, 3)) if simulated else None
    out = tmp_path / "x.png"
    draw_schedule(sched, out, result=result)
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_svg(tmp_path: Path) -> None:
    out = tmp_path / "x.svg"
    draw_schedule(build_schedule("dualpipev", 4, 10), str(out), title="custom title")
    text = out.read_text()
    assert text.startswith("<?xml") or "<svg" in text
    assert "custom title" in text


@pytest.mark.parametrize("suffix", [".pdf", ".PNGX", ""])
def test_bad_suffix(tmp_path: Path, suffix: str) -> None:
    out = tmp_path / f"x{suffix}"
    with pytest.raises(ScheduleError, match="png or .svg"):
        draw_schedule(build_schedule("1f1b", 2, 2), out)
    assert not out.exists()


def test_result_of_other_schedule_is_rejected(tmp_path: Path) -> None:
    other = simulate(build_schedule("1f1b", 4, 4), Costs())
    with pytest.raises(ScheduleError):
        draw_schedule(build_schedule("1f1b", 4, 8), tmp_path / "x.png", result=other)


@pytest.mark.parametrize(
    ("name", "ranks", "microbatches", "chunks"),
    [("dualpipe", 4, 8, None), ("1f1b", 4, 8, None), ("interleaved", 4, 8, 2),
     ("interleaved", 4, 8, 3), ("zb1p", 4, 8, None)],
)
def test_other_schedules_draw(
    tmp_path: Path, name: str, ranks: int, microbatches: int, chunks: int | None
) -> None:
    sched = build_schedule(name, ranks, microbatches, chunks)
    out = tmp_path / "x.png"
    draw_schedule(sched, out, result=simulate(sched, Costs()))
    assert out.read_bytes().startswith(PNG_MAGIC)
