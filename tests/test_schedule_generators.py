"""Generators produce valid schedules; the validator catches each kind of broken schedule."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpipe_megatron.schedules import (
    B, F, FB, Key, ScheduleError, ValidationError, W, build_schedule, validate,
)

pytestmark = pytest.mark.unit


@st.composite
def shapes(draw: st.DrawFn, name: str) -> tuple[int, int]:
    ranks = draw(st.integers(2, 32).filter(lambda p: name != "dualpipe" or p % 2 == 0))
    m = draw(st.integers(2 * ranks, 8 * ranks).filter(lambda m: name != "dualpipe" or m % 2 == 0))
    return ranks, m


def group_for(ranks: int, m: int) -> int | None:
    """Megatron's default group (P) where its remainder rule allows it, else one group."""
    return None if m % ranks == 0 or m % ranks >= ranks else m


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe", "1f1b", "zb1p", "interleaved"])
def test_generators_are_valid(name: str) -> None:
    @settings(max_examples=25, deadline=None)
    @given(shapes(name))
    def run(shape: tuple[int, int]) -> None:
        ranks, m = shape
        group = group_for(ranks, m) if name == "interleaved" else None
        sched = build_schedule(name, ranks, m, group_size=group)
        order = validate(sched)
        assert len(order) == sum(len(ops) for ops in sched.ops)

    run()


@pytest.mark.parametrize("name,ranks,m,fragment", [
    ("dualpipe", 3, 12, "even number of ranks"),
    ("dualpipe", 4, 9, "even number of microbatches"),
    ("dualpipe", 4, 6, "microbatches >= 2*ranks"),
    ("dualpipev", 4, 7, "microbatches >= 2*ranks (8)"),
    ("interleaved", 4, 10, "Megatron requires 0 or >= ranks"),
    ("nope", 4, 8, "unknown schedule 'nope'"),
])
def test_bad_shapes_are_rejected(name: str, ranks: int, m: int, fragment: str) -> None:
    with pytest.raises(ScheduleError, match=re.escape(fragment)):
        build_schedule(name, ranks, m)


def _dpv():
    return build_schedule("dualpipev", 2, 4)


def test_missing_op() -> None:
    sched = _dpv()
    dropped = sched.ops[1].pop()
    with pytest.raises(ValidationError, match="missing W"):
        validate(sched)
    assert isinstance(dropped, W)


def test_duplicate_op() -> None:
    sched = _dpv()
    sched.ops[0].append(sched.ops[0][0])
    with pytest.raises(ValidationError, match=r"rank 0 op #\d+ F\(d=0,s=0,m=0\): duplicate"):
        validate(sched)


def test_broken_local_dependency_names_the_op() -> None:
    sched = _dpv()
    ops = sched.ops[0]
    ops.insert(0, ops.pop(ops.index(next(o for o in ops if isinstance(o, B)))))
    with pytest.raises(ValidationError, match=r"rank 0 op #0 B\(d=0,s=3,m=0\).*breaks a dependency"):
        validate(sched)


def test_stage_on_two_ranks() -> None:
    sched = _dpv()
    sched.placement.clear()  # only the op lists now say where stages live
    moved = sched.ops[0].pop(0)
    sched.ops[1].insert(0, moved)
    with pytest.raises(ValidationError, match=r"stage \(d=0,s=0\) is on two ranks"):
        validate(sched)


def test_misplaced_stage() -> None:
    sched = _dpv()
    sched.ops[1].insert(0, sched.ops[0].pop(0))
    with pytest.raises(ValidationError, match="placed on rank 0 but this op runs on rank 1"):
        validate(sched)


def test_deadlock_names_the_cycle() -> None:
    # Rank 0 wants B(m=0) back before sending F(m=1); rank 1 wants F(m=1) before sending it.
    sched = build_schedule("1f1b", 2, 2)
    sched.ops[0] = [F(Key(0, 0, 0)), B(Key(0, 0, 0)), F(Key(0, 0, 1)), B(Key(0, 0, 1))]
    sched.ops[1] = [F(Key(0, 1, 0)), F(Key(0, 1, 1)), B(Key(0, 1, 0)), B(Key(0, 1, 1))]
    with pytest.raises(ValidationError) as err:
        validate(sched)
    msg = str(err.value)
    assert msg.startswith("deadlock at rank 0 op #1 B(d=0,s=0,m=0)")
    assert "rank 0 at op #1 B(d=0,s=0,m=0) waits for B(d=0,s=1,m=0) on rank 1" in msg
    assert "rank 1 at op #1 F(d=0,s=1,m=1) waits for F(d=0,s=0,m=1) on rank 0" in msg


def test_fb_cannot_backward_its_own_forward() -> None:
    sched = build_schedule("1f1b", 1, 1)
    sched.ops[0] = [FB(F(Key(0, 0, 0)), B(Key(0, 0, 0)))]
    with pytest.raises(ValidationError, match="breaks a dependency"):
        validate(sched)


def test_json_round_trip() -> None:
    from dualpipe_megatron.schedules import Schedule

    for name in ("dualpipev", "dualpipe", "zb1p"):
        sched = build_schedule(name, 4, 10 if name != "dualpipe" else 12)
        back = Schedule.from_json_obj(sched.to_json_obj())
        assert back.ops == sched.ops and back.placement == sched.placement
