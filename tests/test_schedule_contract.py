"""Every generator's `dump` output obeys the JSON contract (checked independently)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from dualpipe_megatron.schedules import GENERATORS
from dualpipe_megatron.schedules.cli import main

from contract_checker import check

pytestmark = pytest.mark.unit


PROGRAMS_UP_TO = 8  # ranks up to which the dumps carry their programs (lowering P=16 costs ~0.3 s a dump)


def dump(name: str, ranks: int, m: int) -> dict:
    argv = ["dump", "--schedule", name, "--ranks", str(ranks), "--microbatches", str(m)]
    if ranks > PROGRAMS_UP_TO:
        argv.append("--no-programs")
    if name == "interleaved" and 0 < m % ranks < ranks:
        argv += ["--group-size", str(m)]  # Megatron rejects its default grouping for this M
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_dump_obeys_contract(name: str) -> None:
    checked = 0
    for ranks in range(2, 17):
        if name == "dualpipe" and ranks % 2:
            continue
        for m in sorted({2 * ranks, 2 * ranks + 1, 3 * ranks, 4 * ranks}):  # the edges and the middle
            if name == "dualpipe" and m % 2:
                continue
            if name == "chimera" and (ranks % 2 or m % ranks):
                continue  # chimera concatenates whole units of P micro-batches on an even P
            doc = dump(name, ranks, m)
            assert doc["schedule"] == name and doc["ranks"] == ranks and doc["microbatches"] == m
            assert ("programs" in doc) == (ranks <= PROGRAMS_UP_TO)
            check(doc)
            checked += 1
    assert checked >= (24 if name in ("chimera", "dualpipe") else 60)


def test_checker_rejects_a_broken_dump() -> None:
    doc = dump("dualpipev", 2, 4)
    ops = doc["ops"][0]
    ops.insert(0, ops.pop())  # a W first: it cannot run before its B
    with pytest.raises(AssertionError):
        check(doc)


@pytest.mark.parametrize("breakage", ["reorder pair", "drop wait", "late wait", "early send", "wrong peer"])
def test_checker_rejects_broken_programs(breakage: str) -> None:
    doc = dump("dualpipev", 4, 8)
    check(doc)
    events = doc["programs"]["1"]
    posts = [i for i, e in enumerate(events) if e.get("post") == "recv" and e["peer"] == 0]
    first_wait = next(i for i, e in enumerate(events) if "wait" in e)
    first_run = next(i for i, e in enumerate(events) if "run" in e)
    if breakage == "reorder pair":  # rank 1 receives rank 0's first two messages the other way round
        a, b = posts[:2]
        events[a]["id"], events[b]["id"] = events[b]["id"], events[a]["id"]
    elif breakage == "drop wait":
        del events[first_wait]
    elif breakage == "late wait":  # the first op runs before its input arrived
        events[first_wait], events[first_run] = events[first_run], events[first_wait]
    elif breakage == "early send":
        send = next(i for i, e in enumerate(doc["programs"]["0"]) if e.get("post") == "send")
        doc["programs"]["0"].insert(0, doc["programs"]["0"].pop(send))
    else:
        events[posts[0]]["peer"] = 2
    with pytest.raises(AssertionError):
        check(doc)
