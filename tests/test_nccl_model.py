"""The NCCL ordering model: the controls of the design note, rendezvous, collectives, queues, input checks."""

from __future__ import annotations

import json
import re

import pytest

from dualpipe_megatron.runtime.nccl_model import check, load_programs

pytestmark = pytest.mark.unit


def send(i: int, peer: int, group: str = "pp", what: str = "") -> dict:
    return {"post": "send", "group": group, "peer": peer, "id": i, "what": what or f"send {i}"}


def recv(i: int, peer: int, group: str = "pp", what: str = "") -> dict:
    return {"post": "recv", "group": group, "peer": peer, "id": i, "what": what or f"recv {i}"}


def batch(i: int, *ops: tuple[str, int], group: str = "pp") -> dict:
    return {"post": "batch", "group": group, "id": i, "what": f"batch {i}",
            "ops": [{"kind": k, "peer": p} for k, p in ops]}


def coll(i: int, name: str, group: str, members=(0, 1)) -> dict:
    return {"post": "coll", "group": group, "members": list(members), "name": name, "id": i, "what": f"{name} {i}"}


def wait(*ids: int) -> dict:
    return {"wait": list(ids), "what": f"wait {list(ids)}"}


def parity_programs(ranks: int, rounds: int, ring: bool = False) -> dict[int, list[dict]]:
    """Megatron's unbatched ``_p2p_ops`` order: even ranks send-next, recv-prev, send-prev, recv-next;
    odd ranks recv-prev, send-next, recv-next, send-prev; then wait for all four."""
    programs = {}
    for r in range(ranks):
        nxt = (r + 1) % ranks if ring or r + 1 < ranks else None
        prv = (r - 1) % ranks if ring or r > 0 else None
        order = ([("send", nxt), ("recv", prv), ("send", prv), ("recv", nxt)] if r % 2 == 0
                 else [("recv", prv), ("send", nxt), ("recv", nxt), ("send", prv)])
        events, next_id = [], 0
        for _ in range(rounds):
            ids = []
            for kind, peer in order:
                if peer is not None:
                    events.append((send if kind == "send" else recv)(next_id, peer))
                    ids.append(next_id)
                    next_id += 1
            events.append(wait(*ids))
        programs[r] = events
    return programs


def test_unbatched_send_then_recv_on_both_ranks_deadlocks():
    v = check({r: [send(0, 1 - r), recv(1, 1 - r), wait(0, 1)] for r in (0, 1)})
    assert not v.ok
    assert v.cycle in ([0, 1, 0], [1, 0, 1])
    assert set(v.blocked) == {0, 1}
    assert "waits for send #0 to rank 1 (send 0) and 1 more in wait (wait [0, 1])" in v.blocked[0]
    assert "head of (pp, 0<->1) on rank 1 is send #0 to rank 0" in v.blocked[0]
    assert v.heads["(pp, 0<->1) on rank 0"].startswith("send #0 to rank 1")
    assert v.summary.startswith("DEADLOCK: 2 of 2 ranks blocked, cycle")
    report = v.report()
    assert "blocked ranks:" in report and "queue heads:" in report and "wait-for cycle: rank" in report


def test_recv_waited_behind_a_send_says_so():
    v = check({0: [send(0, 1), recv(1, 1), wait(1)], 1: [send(0, 0), recv(1, 0), wait(1)]})
    assert "waits for recv #1 from rank 1" in v.blocked[0]
    assert "behind send #0 to rank 1 (send 0) at the head of queue (pp, 0<->1) on rank 0" in v.blocked[0]
    assert v.cycle in ([0, 1, 0], [1, 0, 1])


def test_one_send_recv_batch_on_both_ranks_passes():
    v = check({r: [batch(0, ("send", 1 - r), ("recv", 1 - r)), wait(0)] for r in (0, 1)})
    assert v.ok, v.report()
    assert v.summary == "deadlock-free: 2 ranks, 4 events"
    assert v.blocked == {} and v.heads == {} and v.cycle == []


@pytest.mark.parametrize("warm", [(), [("pp", 0, 1), ("pp", 2, 1), ("pp", 2, 3)]])
def test_megatron_parity_order_passes_on_a_chain(warm):
    v = check(parity_programs(4, rounds=5), unbatched="pair", warm=warm)
    assert v.ok, v.report()


def test_first_use_rendezvous_deadlock_and_warm_pairs():
    # 0 first talks to 1; 1 first waits for 2; 2 sends to 1 only after receiving from 0.
    programs = {
        0: [send(0, 1), send(1, 2), wait(0, 1)],
        1: [recv(0, 2), wait(0), recv(1, 0), wait(1)],
        2: [recv(0, 0), wait(0), send(1, 1), wait(1)],
    }
    v = check(programs)
    assert not v.ok
    assert "first use of pair (pp, 0<->1)" in v.blocked[0] and "rank 1" in v.blocked[0]
    assert sorted(v.cycle[:-1]) == [0, 1, 2] and v.cycle[0] == v.cycle[-1]
    assert check(programs, warm=[("pp", 0, 1), ("pp", 1, 2), ("pp", 0, 2)]).ok


def test_collectives_in_opposite_orders_deadlock_same_order_passes():
    tp, dp = coll(0, "allreduce", "tp"), coll(1, "allreduce", "dp")
    v = check({0: [tp, wait(0), dp, wait(1)], 1: [dp, wait(1), tp, wait(0)]})
    assert not v.ok and v.cycle in ([0, 1, 0], [1, 0, 1])
    assert "rank 1 has not posted it" in v.blocked[0]
    assert check({r: [tp, wait(0), dp, wait(1)] for r in (0, 1)}).ok
    # Without host waits the two groups' queues are independent.
    assert check({0: [tp, dp, wait(0, 1)], 1: [dp, tp, wait(0, 1)]}).ok


def test_collective_mismatch_is_reported():
    v = check({0: [coll(0, "allreduce", "dp"), wait(0)], 1: [coll(0, "allgather", "dp"), wait(0)]})
    assert not v.ok and len(v.mismatch) == 1
    assert "allreduce #0" in v.mismatch[0] and "allgather #0" in v.mismatch[0]
    assert "collective mismatch" in v.summary and "collective mismatches:" in v.report()


def test_crossing_order_passes_per_pair_but_deadlocks_on_one_group_queue():
    # Each rank receives from one neighbour, then sends to the other; every pair agrees on
    # its own order, but one queue per rank puts every receive ahead of every send.
    programs = {
        0: [recv(0, 1), send(1, 2), wait(0, 1)],
        1: [recv(0, 2), send(1, 0), wait(0, 1)],
        2: [recv(0, 0), send(1, 1), wait(0, 1)],
    }
    warm = [("pp", 0, 1), ("pp", 1, 2), ("pp", 0, 2)]
    assert check(programs, warm=warm).ok
    v = check(programs, unbatched="group")
    assert not v.ok and v.cycle in ([0, 1, 2, 0], [1, 2, 0, 1], [2, 0, 1, 2])
    assert "(pp) on rank 0" in v.heads


def test_batch_send_and_recv_to_one_peer_do_not_block_each_other():
    # Both ranks put their receive first: fine inside one batch, a deadlock unbatched.
    assert check({r: [batch(0, ("recv", 1 - r), ("send", 1 - r)), wait(0)] for r in (0, 1)}).ok
    assert not check({r: [recv(0, 1 - r), send(1, 1 - r), wait(0, 1)] for r in (0, 1)}).ok


def test_batch_keeps_same_peer_same_direction_order():
    # Two sends to one peer in one batch match that peer's receives in order, one by one.
    two_sends = [batch(0, ("send", 1), ("send", 1)), wait(0)]
    assert check({0: two_sends, 1: [batch(0, ("recv", 0)), batch(1, ("recv", 0)), wait(0, 1)]}).ok
    assert check({0: two_sends, 1: [batch(0, ("recv", 0), ("recv", 0)), wait(0)]}).ok
    v = check({0: two_sends, 1: [batch(0, ("recv", 0)), wait(0)]})
    assert not v.ok and v.blocked.keys() == {0}
    assert "batch #0 [send to 1 (done), send to 1]" in v.blocked[0]
    assert "rank 1, which has not posted the matching op" in v.blocked[0]


def test_a_batch_does_not_match_unbatched_ops_across_communicators():
    # Per-pair mode: the unbatched send is on the pair's communicator, the batch on the group's.
    programs = {0: [send(0, 1), wait(0)], 1: [batch(0, ("recv", 0)), wait(0)]}
    assert not check(programs, warm=[("pp", 0, 1)]).ok
    assert check(programs, unbatched="group").ok


def test_leftover_send_is_not_ok():
    v = check({0: [batch(0, ("send", 1))], 1: []})
    assert not v.ok and v.blocked == {} and v.cycle == []
    assert v.leftover == ["rank 0: batch #0 [send to 1] (batch 0)"]
    assert v.summary.startswith("NOT OK: all 2 programs finished but 1 posted op(s) never completed")
    assert "never completed:" in v.report()


@pytest.mark.parametrize("programs, message", [
    ({0: [{"post": "bcast", "group": "pp", "id": 0}]}, "unknown event"),
    ({0: [{"go": 1}]}, "unknown event"),
    ({0: [send(0, 1), send(0, 1)], 1: []}, "duplicate id 0"),
    ({0: [wait(3)]}, "waits on id(s) [3]"),
    ({0: [wait(0), send(0, 1)], 1: []}, "waits on id(s) [0]"),
    ({0: [send(0, 5)]}, "peer 5 is not another rank"),
    ({0: [send(0, 0)]}, "peer 0 is not another rank"),
    ({0: [{"post": "send", "group": "pp", "id": 0}], 1: []}, "missing field 'peer'"),
    ({0: [batch(0, ("put", 1))], 1: []}, "send/recv"),
    ({0: [coll(0, "allreduce", "dp", members=(1, 2))], 1: [], 2: []}, "must include this rank"),
])
def test_invalid_input_raises(programs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check(programs)


def test_invalid_unbatched_mode():
    with pytest.raises(ValueError, match="unbatched"):
        check({0: []}, unbatched="stream")


def test_load_programs_accepts_both_shapes(tmp_path):
    programs = {r: [batch(0, ("send", 1 - r), ("recv", 1 - r)), wait(0)] for r in (0, 1)}
    wrapped, bare = tmp_path / "wrapped.json", tmp_path / "bare.json"
    wrapped.write_text(json.dumps({"programs": programs}))
    bare.write_text(json.dumps(programs))
    for source in (wrapped, str(bare), json.loads(bare.read_text())):
        loaded = load_programs(source)
        assert loaded == programs and check(loaded).ok


def test_ring_of_16_ranks_with_3000_events_each():
    """Sweep-sized input (the model's speed is measured, not asserted: it is about a second)."""
    programs = parity_programs(16, rounds=600, ring=True)
    assert all(len(events) == 3000 for events in programs.values())
    v = check(programs)
    assert v.ok, v.summary
