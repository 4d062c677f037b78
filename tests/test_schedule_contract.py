"""Every generator's `dump` output obeys the JSON contract (checked independently)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from dualpipe_megatron.schedules import GENERATORS
from dualpipe_megatron.schedules.cli import main

from contract_checker import check


def dump(name: str, ranks: int, m: int) -> dict:
    argv = ["dump", "--schedule", name, "--ranks", str(ranks), "--microbatches", str(m)]
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
            check(doc)
            checked += 1
    assert checked >= (24 if name in ("chimera", "dualpipe") else 60)


def test_checker_rejects_a_broken_dump() -> None:
    doc = dump("dualpipev", 2, 4)
    ops = doc["ops"][0]
    ops.insert(0, ops.pop())  # a W first: it cannot run before its B
    with pytest.raises(AssertionError):
        check(doc)
