"""Lowering: the published per-rank programs pass the NCCL model, are what the runtime posts,
and are checked against the ops when a schedule file is read."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from typing import Any

import pytest

from contract_checker import check
from dualpipe_megatron.runtime import cli as runtime_cli
from dualpipe_megatron.runtime.dry_run import Case, record
from dualpipe_megatron.runtime.plan import MessagePlan
from dualpipe_megatron.schedules import Schedule, ScheduleError, build_schedule
from dualpipe_megatron.schedules.cli import main
from dualpipe_megatron.schedules.lower import lower, lower_all, read_schedule

pytestmark = pytest.mark.unit

CASES = [("dualpipev", 2, 4), ("dualpipev", 4, 10), ("dualpipe", 2, 4), ("dualpipe", 4, 8)]


def dump(name: str, ranks: int, m: int, *extra: str) -> dict[str, Any]:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["dump", "--schedule", name, "-P", str(ranks), "-M", str(m), *extra]) == 0
    return json.loads(buf.getvalue())


@pytest.mark.parametrize("name,ranks,m", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_dump_passes_nccl_check(tmp_path, capsys, name: str, ranks: int, m: int, forward_only: bool) -> None:
    doc = dump(name, ranks, m, *(["--forward-only"] if forward_only else []))
    assert doc["forward_only"] is forward_only and set(doc["programs"]) == {str(r) for r in range(ranks)}
    check(doc)
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps(doc))
    for queues in ("pair", "group"):
        assert runtime_cli.main(["nccl-check", str(path), "--queues", queues]) == 0
        assert capsys.readouterr().out.startswith(f"deadlock-free: {ranks} ranks")


def _comm(events: list[dict[str, Any]]) -> tuple[list, list]:
    """A rank's posts (kind, peer, what) and receive waits (what they wait for, and their own what), in
    order, leaving out the runtime's one-off warm-up of each pair and the program's run events. Send
    waits are left out too: the runtime reaps a completed send without a wait (the dry run's sends all
    complete at once), the program waits for each at the end of the step."""
    what = {e["id"]: e["what"] for e in events if "post" in e}
    warm = {i for i, w in what.items() if w.startswith("warm-up of the pair")}
    recvs = {e["id"] for e in events if e.get("post") == "recv"} - warm
    posts = [(e["post"], e["peer"], e["what"]) for e in events if "post" in e and e["id"] not in warm]
    waits = [([what[i] for i in e["wait"]], e["what"]) for e in events if "wait" in e and set(e["wait"]) <= recvs]
    return posts, waits


@pytest.mark.parametrize("name,ranks,m", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_program_is_what_the_runtime_posts(name: str, ranks: int, m: int, forward_only: bool) -> None:
    """The dry-run recorder (every rank's real executor and p2p layer, F&B pairs through the hook)
    posts exactly the program's sends and receives, in its order, and waits where it does."""
    recorded = record(Case(name, ranks, m, forward_only))
    for program in lower_all(build_schedule(name, ranks, m), forward_only):
        assert _comm(recorded[program.rank]) == _comm(program.events()), f"rank {program.rank}"


def test_message_plan_is_a_view_of_the_program() -> None:
    sched = build_schedule("dualpipev", 4, 10)
    for program in lower_all(sched):
        assert program == lower(sched, program.rank)
        plan = MessagePlan.build(sched, program.rank, False)
        assert (plan.sequence, plan.incoming, plan.peers) == (list(program.sequence), program.incoming,
                                                              program.peers)
        assert plan.index == {(kind, msg): i for i, (kind, msg, _) in enumerate(program.sequence)}


def test_reading_checks_the_programs() -> None:
    doc = dump("dualpipev", 2, 4)
    sched = read_schedule(doc)
    assert sched.to_json_obj() == Schedule.from_json_obj(doc).to_json_obj()
    no_programs = {k: v for k, v in doc.items() if k not in ("programs", "forward_only")}
    assert read_schedule(no_programs).to_json_obj() == sched.to_json_obj()
    events = doc["programs"]["1"]
    at = next(i for i, e in enumerate(events) if "run" in e)
    events[at], events[at + 1] = events[at + 1], events[at]  # rank 1 runs an op before its receive's wait
    with pytest.raises(ScheduleError, match=f"rank 1's event {at} is"):
        read_schedule(doc)
    with pytest.raises(AssertionError):
        check(doc)
    doc = dump("dualpipev", 2, 4)
    doc["programs"]["1"].pop()
    with pytest.raises(ScheduleError, match="rank 1 has"):
        read_schedule(doc)
    with pytest.raises(ScheduleError, match="ranks"):
        read_schedule({**doc, "programs": {"0": doc["programs"]["0"]}})
    with pytest.raises(ScheduleError, match="forward_only"):
        read_schedule({**doc, "forward_only": "no"})
