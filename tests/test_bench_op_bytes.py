"""bench/op_bytes.py, behind bench/budget_memory.py's planned-against-measured columns.

A hand-countable rank: two micro-batches on one stage, each F saving 100 bytes, the first's
B(w=false) capturing 10 bytes of output grads before it releases 70 of the saved, so 40 stay
until its W. The meter's timeline is read against the traced ops; the unit rule weighed in
F bytes peaks at 200, and with B(w=false)'s release at 140, what the timeline holds at most.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from op_bytes import OpBytes, StageBytes, per_op, stage_bytes, weighted_peak  # noqa: E402

from dualpipe_megatron.schedules.ir import B, F, Key, W  # noqa: E402
from dualpipe_megatron.trace.records import OpRecord  # noqa: E402

pytestmark = pytest.mark.unit

K0, K1 = Key(0, 0, 0), Key(0, 0, 1)
OPS = [F(K0), B(K0, w=False), F(K1), W(K0), B(K1)]
SPANS = [(10, 20), (30, 40), (50, 60), (70, 80), (90, 100)]
TIMELINE = [(12, 60), (15, 100), (32, 110), (35, 40), (52, 90), (55, 140), (75, 100), (95, 0)]


def _records() -> list[OpRecord]:
    return [OpRecord(i, op, begin, end, 0) for i, (op, (begin, end)) in enumerate(zip(OPS, SPANS))]


def test_ops_get_the_bytes_live_at_their_ends_and_the_most_in_between() -> None:
    got = per_op(TIMELINE, _records())
    assert [(o.before, o.after, o.top) for o in got] == [
        (0, 100, 100), (100, 40, 110), (40, 140, 140), (140, 100, 140), (100, 0, 100)]


def test_stage_bytes_and_the_weighted_peaks() -> None:
    stages = stage_bytes(per_op(TIMELINE, _records()))
    assert stages == {(0, 0): StageBytes(forward=100, kept=40, spread=0)}
    assert weighted_peak(OPS, stages, release_at_input_grad=False) == 200  # 2 units x 100 bytes
    assert weighted_peak(OPS, stages, release_at_input_grad=True) == 140 == max(v for _, v in TIMELINE)


def test_a_stage_without_a_pure_input_grad_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        stage_bytes([OpBytes(F(Key(0, 1, 0)), 0, 100, 100)])
