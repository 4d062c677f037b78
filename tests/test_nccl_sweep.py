"""The runtime's real posting logic under the NCCL model: sweep, negative controls, CLI, strict mode."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

import nccl_workers
from launcher import spawn
from dualpipe_megatron.runtime import dry_run
from dualpipe_megatron.runtime.comm_log import RECV, SEND
from dualpipe_megatron.runtime.dry_run import Case, check_case, record, sweep_cases
from dualpipe_megatron.runtime.plan import Item, MessagePlan
from dualpipe_megatron.schedules import GENERATORS

pytestmark = pytest.mark.multiprocess

# make test runs this reduced grid; `make nccl-sweep` runs P = 2..16 (1,485 cases, about 15 minutes).
SWEEP_RANKS = [2, 3, 4, 8]


@pytest.mark.parametrize("schedule", sorted(GENERATORS))
def test_sweep_is_deadlock_free(schedule: str) -> None:
    cases = list(sweep_cases([schedule], SWEEP_RANKS))
    assert {c.forward_only for c in cases} == {False, True}
    assert {(c.wgrad_split, c.overlap_hook) for c in cases if not c.forward_only} == {
        (True, True), (True, False), (False, True), (False, False)}
    failed = {str(c): v[0].report() for c in cases for v in [check_case(c)] if v}
    assert not failed, "\n".join(f"{c}:\n{r}" for c, r in failed.items())


def test_sweep_microbatch_counts() -> None:
    counts = {c.microbatches for c in sweep_cases(["dualpipe"], [4])}
    assert counts == {8, 10, 16}  # dualpipe needs an even M: 2P+2 stands in for 2P+1
    assert {c.microbatches for c in sweep_cases(["dualpipev"], [4])} == {8, 9, 16}


def test_recorded_calls_are_the_runtime_calls() -> None:
    """Each message is one post at both ends, and every receive is waited for."""
    case = Case("dualpipev", 2, 4)
    programs = record(case)
    posts = {r: [e for e in events if "post" in e] for r, events in programs.items()}
    sends = {r: sum(e["post"] == SEND for e in p) for r, p in posts.items()}
    recvs = {r: sum(e["post"] == RECV for e in p) for r, p in posts.items()}
    assert sends[0] == recvs[1] and sends[1] == recvs[0] and sends[0] > 2
    waited = {i for e in programs[0] if "wait" in e for i in e["wait"]}
    assert {e["id"] for e in posts[0] if e["post"] == RECV} <= waited  # sends may be reaped unwaited


def _lazy_sequence(plan: MessagePlan, lookahead: int = 2) -> list[Item]:
    """The posting order of the runtime before this model existed: each send at once after its
    op, receives lazily in their sender's order, up to what the next ``lookahead`` ops need."""
    posted = {src: 0 for src in plan.incoming}
    sequence: list[Item] = []

    def post_up_to(msg, src) -> None:
        order = plan.incoming[src]
        while posted[src] <= order.index(msg):
            sequence.append((RECV, order[posted[src]], src))
            posted[src] += 1

    for n in range(len(plan.ops)):
        for per_op in plan.recvs[n:n + 1 + lookahead]:
            for needs in per_op:
                for msg, src in needs:
                    post_up_to(msg, src)
        for sends in plan.sends[n]:
            sequence += [(SEND, msg, dst) for msg, dst in sends]
    return sequence


def _with_sequence(monkeypatch: pytest.MonkeyPatch, make) -> None:
    built = MessagePlan.build

    class Reordered(MessagePlan):
        @classmethod
        def build(cls, sched, rank, forward_only):
            plan = built(sched, rank, forward_only)
            return replace(plan, sequence=make(plan))

    monkeypatch.setattr(dry_run, "MessagePlan", Reordered)


@pytest.mark.parametrize("schedule,ranks", [("dualpipev", 2), ("dualpipev", 4), ("dualpipe", 2), ("dualpipe", 4)])
def test_the_old_lazy_order_deadlocks(monkeypatch: pytest.MonkeyPatch, schedule: str, ranks: int) -> None:
    """Negative control: the check fails the posting order this issue replaced."""
    _with_sequence(monkeypatch, _lazy_sequence)
    failed = check_case(Case(schedule, ranks, 2 * ranks))
    assert failed and failed[0].cycle, "the lazy order should deadlock under the NCCL model"
    assert "DEADLOCK" in failed[0].report()


def test_receives_first_order_deadlocks(monkeypatch: pytest.MonkeyPatch) -> None:
    _with_sequence(monkeypatch, lambda plan: sorted(plan.sequence, key=lambda item: item[0] != RECV))
    assert check_case(Case("1f1b", 2, 4))


def test_cli_controls_sweep_and_check(tmp_path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dualpipe_megatron.runtime", *args],
                              capture_output=True, text=True, timeout=300)

    out = cli("nccl-controls")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "expected: deadlock)" in lines[0] and lines[1].strip().startswith("DEADLOCK")
    assert lines[3].strip().startswith("deadlock-free") and lines[5].strip().startswith("deadlock-free")
    out = cli("nccl-sweep", "--schedules", "dualpipev", "--ranks", "2", "3")
    assert out.returncode == 0 and "0 failed" in out.stdout, out.stdout + out.stderr
    bad = {0: [{"post": "send", "group": "g", "peer": 1, "id": 0, "what": "x"},
               {"post": "recv", "group": "g", "peer": 1, "id": 1, "what": "y"}, {"wait": [0, 1], "what": "w"}],
           1: [{"post": "send", "group": "g", "peer": 0, "id": 0, "what": "y"},
               {"post": "recv", "group": "g", "peer": 0, "id": 1, "what": "x"}, {"wait": [0, 1], "what": "w"}]}
    path = tmp_path / "calls.json"
    path.write_text(json.dumps({"programs": bad}))
    out = cli("nccl-check", str(path))
    assert out.returncode == 1 and "DEADLOCK" in out.stdout, out.stdout + out.stderr
    out = cli("nccl-check", str(tmp_path / "missing.json"))
    assert out.returncode == 2 and out.stderr.startswith("error: cannot read")


def test_strict_mode_fails_a_real_step_that_gloo_completes() -> None:
    """Strict mode is not vacuous: an unsafe order runs fine on gloo, and every rank's step fails."""
    results = spawn(2, nccl_workers.unsafe_order_step, timeout=120)
    for rank, got in enumerate(results):
        assert got["error"] == "NcclDeadlockError", f"rank {rank}: {got}"
        assert "DEADLOCK" in got["message"] and "cycle" in got["message"], got["message"]
