"""The events core: the op-kind table's rules, the cross-rank rules and the timer in three number types."""

from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

import pytest

from dualpipe_megatron.schedules import GENERATORS, build_schedule
from dualpipe_megatron.schedules.events import (Encoder, Replay, live_change, needs, op_needs, peak,
                                                peak_live_activations, produces, receives, sends, timing)
from dualpipe_megatron.schedules.ir import FB, B, F, Key, Schedule, W, halves

pytestmark = pytest.mark.unit


def test_the_table_gives_the_contract_rules() -> None:
    k = Key(1, 2, 3)
    assert needs(F(k), 4) == [("F", Key(1, 1, 3))]
    assert needs(F(Key(1, 0, 3)), 4) == []
    assert needs(B(k), 4) == needs(B(k, False), 4) == [("F", k), ("B", Key(1, 3, 3))]
    assert needs(B(Key(1, 3, 3)), 4) == [("F", Key(1, 3, 3))]
    assert needs(W(k), 4) == [("B", k)]
    assert produces(FB(F(k), B(Key(0, 1, 0), False))) == [("F", k), ("B", Key(0, 1, 0))]
    assert [live_change(op) for op in (F(k), B(k), B(k, False), W(k), FB(F(k), B(k)))] == [
        (1, 0), (0, 1), (0, 0), (0, 1), (1, 1)]
    assert peak_live_activations([F(k), F(Key(1, 2, 4)), B(k, False), FB(F(Key(1, 2, 5)), B(Key(1, 2, 4))),
                                  W(k)]) == 3


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_message_is_sent_once_and_received_once(name: str) -> None:
    """What the halves receive is exactly what the halves send, (event, source, destination) each."""
    for ranks in (2, 3, 4):
        try:
            sched = build_schedule(name, ranks, 4 * ranks)
        except ValueError:
            continue
        sent, got = Counter(), Counter()
        for rank, _, op in sched.iter_ops():
            for h in halves(op):
                sent.update((e, rank, dst) for e, dst in sends(sched, h))
                got.update((e, src, rank) for e, src in receives(sched, h))
        assert sent == got and max(sent.values()) == 1
        assert sum(sent.values()) == sum(1 for r, _, op in sched.iter_ops() for h in halves(op)
                                         for e in needs(h, sched.stages) if sched.rank_of(e[1].d, e[1].s) != r)


def _two_rank(zero, one, latency) -> tuple[Schedule, list, list]:
    sched = build_schedule("1f1b", 2, 2)
    enc = Encoder(sched)
    flat = [op for ops in sched.ops for op in ops]
    durations = [one * (2 if isinstance(op, B) else 1) for op in flat]
    lists, i = [], 0
    for ops in sched.ops:
        lists.append([enc.encode(op, i + j, latency, zero) for j, op in enumerate(ops)])
        i += len(ops)
    return sched, lists, durations


@pytest.mark.parametrize("zero,one,latency", [(Fraction(0), Fraction(1), Fraction(1, 2)), (0, 2, 1),
                                              (0.0, 1.0, 0.5)])
def test_timer_in_three_number_types(zero, one, latency) -> None:
    """1F1B, P=2, M=2, F = 1, B = 2 and c = 1/2 (times two in integers): the step is 10."""
    sched, lists, durations = _two_rank(zero, one, latency)
    t = timing(lists, durations, Encoder(sched).size, zero)
    assert t.complete and t.ran == [4, 4]
    assert t.makespan == 10 * one and type(t.makespan) is type(zero)
    assert t.start[1] == [one + latency, 2 * one + latency, 4 * one + latency, 5 * one + latency]
    assert [peak(ops) for ops in lists] == [2, 1]


def test_a_stalled_order_is_reported_with_what_ran() -> None:
    sched, lists, durations = _two_rank(0, 1, 0)
    lists[1] = [lists[1][1], lists[1][0], *lists[1][2:]]  # rank 1 backs up micro-batch 0 before its forward
    t = timing(lists, durations, Encoder(sched).size)
    assert not t.complete and t.ran == [2, 0]


@pytest.mark.parametrize("name,ranks,m", [("dualpipev", 3, 9), ("dualpipe", 4, 8), ("zb1p", 3, 6)])
def test_replay_times_like_the_event_driven_timer(name: str, ranks: int, m: int) -> None:
    """Replay's one-pass timing in its completion order equals timing() for new durations."""
    sched = build_schedule(name, ranks, m)
    enc = Encoder(sched)
    flat = [op for ops in sched.ops for op in ops]
    lists, i = [], 0
    for ops in sched.ops:
        lists.append([enc.encode(op, i + j, 3) for j, op in enumerate(ops)])
        i += len(ops)
    replay = Replay(lists, enc.size)
    assert sorted(replay.order) == [(r, j) for r, ops in enumerate(sched.ops) for j in range(len(ops))]
    rng = random.Random(5)
    for _ in range(3):
        durations = [rng.randint(1, 9) for _ in flat]
        assert replay.makespan(durations) == timing(lists, durations, enc.size).makespan


@pytest.mark.parametrize("name", ["dualpipev", "dualpipe"])
def test_a_resumed_timing_equals_the_full_one(name: str) -> None:
    """timing(since=...) re-times only what follows the first changed op: after any of the
    optimizer's moves it gives every start, the makespan and validity exactly as timing() does."""
    from dualpipe_megatron.schedules.local_search import moves_at
    from dualpipe_megatron.schedules.order_model import OrderModel
    from dualpipe_megatron.schedules.simulate import StageCost, StageCosts

    sched = build_schedule(name, 4, 8)
    rng = random.Random(3)
    costs = StageCosts({ds: StageCost(Fraction(rng.randint(7, 13), 10), Fraction(2), Fraction(1, 2))
                        for ds in sched.placement}, Fraction(4, 5), Fraction(1, 20))
    model = OrderModel(sched, costs)
    lists = [[model.enc(op) for op in ops] for ops in sched.ops]
    old = model.time(lists)
    checked = invalid = 0
    for _ in range(150):
        r = rng.randrange(sched.ranks)
        for at, changed in moves_at(model, lists[r], rng.randrange(len(lists[r]))):
            trial = lists[:r] + [changed] + lists[r + 1:]
            full, resumed = model.time(trial), model.time(trial, (old, r, at))
            assert (full is None) == (resumed is None)
            if full is None:
                invalid += 1
                continue
            assert (full.start, full.finish, full.makespan) == (resumed.start, resumed.finish, resumed.makespan)
            checked += 1
    assert checked > 500 and invalid > 0  # both outcomes were exercised


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_the_encoder_follows_the_kinds_table(name: str) -> None:
    """Encoder.encode (per-kind-and-stage templates shifted by micro-batch) gives each op the
    events op_needs and produces name, the latency on exactly the needs made on another rank,
    and live_change's memory, for every op of DeepSeek's order (F&B pairs, full backwards) and of
    its split form (B(w=false), W), both directions."""
    from dualpipe_megatron.schedules.optimize import _split_weight_grads

    sched = build_schedule(name, 4, 8)
    enc = Encoder(sched)
    for ops in (sched.ops, _split_weight_grads(sched.ops)):
        for rank, rank_ops in enumerate(ops):
            for op in rank_ops:
                got = enc.encode(op, 7, "c", "0")
                assert got.needs == tuple((enc.id(e), "c" if sched.rank_of(e[1].d, e[1].s) != rank else "0")
                                          for e in op_needs(op, sched.stages))
                assert got.makes == tuple(enc.id(e) for e in produces(op))
                assert (got.starts, got.frees) == live_change(op) and got.cost == 7 and got.op is op
