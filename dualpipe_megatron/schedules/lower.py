"""Lowering: one rank's program (its compute ops plus its sends and receives) from a schedule.

NCCL runs the unbatched sends and receives between two ranks in host posting
order on one stream, both directions together, and a send may not finish before
the peer's receive runs. So both ends of a pair must post their messages in the
same order, and that order must never make a rank wait for a message that can
only be sent after something the rank posts later.

The order used here: time every rank's op list with unit costs (an op starts
when its rank is free and the messages it needs were sent; a message leaves at
the end of the op that makes it) and sort all messages by (send time, sender,
sender's order). Each rank posts exactly its own sends and receives in that
order. By induction over the order, every message gets posted at both ends
without waiting for a later one, whether the pair shares one queue or the rank
has one queue for the whole group, so no rank can wait forever
(``docs/nccl.md`` has the argument).

The order is pure schedule data, so it lives here, below the runtime: the
runtime's :class:`~dualpipe_megatron.runtime.plan.MessagePlan` is a view of a
:class:`Program`, and :meth:`Program.events` is the program in the event form
the NCCL model and strict mode read (``docs/schedule_format.md``, ``programs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import events as core
from .events import Event
from .ir import FB, B, F, Key, Op, Schedule, ScheduleError, W, halves, op_to_json

ACT = "activation"
GRAD = "gradient"
SEND = "send"
RECV = "recv"
GROUP = "pipeline"  # the group name in published programs (the dry-run transport's name)

Half = F | B | W


@dataclass(frozen=True)
class Message:
    """One transfer: the outputs of ``F(key)`` (ACT) or the input grads of ``B(key)`` (GRAD)."""

    kind: str
    key: Key

    @property
    def edge(self) -> tuple[int, int]:
        """``(d, s)`` of the stage whose outputs (or their grads) travel: it fixes the shapes."""
        k = self.key
        return (k.d, k.s) if self.kind == ACT else (k.d, k.s - 1)

    def __str__(self) -> str:
        return f"{self.kind} of {'F' if self.kind == ACT else 'B'}{self.key}"


Transfer = tuple[Message, int]  # (message, peer pipeline rank)
Item = tuple[str, Message, int]  # (SEND or RECV, message, peer pipeline rank)
Routed = tuple[Message, int, int]  # (message, source, destination)


def executed_halves(op: Op, forward_only: bool) -> tuple[Half, ...]:
    """The single ops a rank actually runs for ``op`` (forward-only keeps the F's)."""
    parts = halves(op)
    return tuple(h for h in parts if isinstance(h, F)) if forward_only else parts


_MESSAGE_OF = {"F": ACT, "B": GRAD}  # the event whose completion a message carries -> its kind
_EVENT_OF = {kind: event for event, kind in _MESSAGE_OF.items()}


def _message(event: Event, half: Half) -> Message:
    name, key = event
    if name not in _MESSAGE_OF:
        raise ScheduleError(f"{half} exchanges event {name}{key} across ranks, and no message kind carries it")
    return Message(_MESSAGE_OF[name], key)


def sent_by(sched: Schedule, half: Half) -> list[Transfer]:
    """Cross-rank messages ``half`` produces (the events core's rule), as (message, destination)."""
    return [(_message(e, half), dst) for e, dst in core.sends(sched, half)]


def needed_by(sched: Schedule, half: Half) -> list[Transfer]:
    """Cross-rank messages ``half`` waits for (the events core's rule), as (message, source)."""
    return [(_message(e, half), src) for e, src in core.receives(sched, half)]


@dataclass(frozen=True)
class _RankOps:
    """One rank's executed ops with what each half receives first and sends after."""

    ops: tuple[tuple[int, tuple[Half, ...]], ...]
    recvs: tuple[tuple[tuple[Transfer, ...], ...], ...]
    sends: tuple[tuple[tuple[Transfer, ...], ...], ...]

    @classmethod
    def of(cls, sched: Schedule, rank: int, forward_only: bool) -> "_RankOps":
        ops = [(i, executed_halves(op, forward_only)) for i, op in enumerate(sched.ops[rank])]
        ops = [(i, parts) for i, parts in ops if parts]
        return cls(
            tuple(ops),
            tuple(tuple(tuple(needed_by(sched, h)) for h in parts) for _, parts in ops),
            tuple(tuple(tuple(sent_by(sched, h)) for h in parts) for _, parts in ops),
        )


def _order(sched: Schedule, per_rank: list[_RankOps]) -> list[Routed]:
    """The events core's timer at unit costs (an op lasts one step per half it runs, messages take
    no time) over the cross-rank needs only (a rank's own order already holds its local ones);
    the messages sorted by (send time, sender, sender's order)."""
    encoder = core.Encoder(sched)

    def event_id(msg: Message) -> int:
        return encoder.id((_EVENT_OF[msg.kind], msg.key))

    lists = [[core.TimedOp(len(parts), tuple((event_id(msg), 0) for per_half in recvs for msg, _ in per_half),
                           tuple(event_id(msg) for per_half in sends for msg, _ in per_half), 0, 0,
                           executed_op(parts))
              for (_, parts), recvs, sends in zip(own.ops, own.recvs, own.sends)] for own in per_rank]
    timed = core.timing(lists, (0, 1, 2), encoder.size)  # cost index n: an op of n halves lasts n
    if not timed.complete:
        stuck = {r: str(own.ops[n][1]) for r, (own, n) in enumerate(zip(per_rank, timed.ran)) if n < len(own.ops)}
        raise ValueError(f"schedule {sched.name!r} cannot run: ops waiting for messages never sent: {stuck}")
    keyed = [((start + len(parts), r, n, j), msg, r, dst)
             for r, own in enumerate(per_rank)
             for n, ((_, parts), start) in enumerate(zip(own.ops, timed.start[r]))
             for j, (msg, dst) in enumerate(t for per_half in own.sends[n] for t in per_half)]
    return [(msg, src, dst) for _, msg, src, dst in sorted(keyed, key=lambda item: item[0])]


def message_order(sched: Schedule, forward_only: bool) -> list[Routed]:
    """Every cross-rank message as (message, source, destination), in the agreed posting order."""
    return _order(sched, [_RankOps.of(sched, r, forward_only) for r in range(sched.ranks)])


def executed_op(parts: tuple[Half, ...]) -> Op:
    """The op a rank runs for these halves: the half itself, or the F&B pair."""
    return parts[0] if len(parts) == 1 else FB(*parts)  # type: ignore[arg-type]


def describe(index: int, parts: tuple[Half, ...]) -> str:
    """An executed op in words, as the runtime names it in its calls: ``op #3 F(d=0,s=1,m=0) (micro-batch 0)``."""
    return f"op #{index} {executed_op(parts)} (micro-batch {parts[0].key.m})"


@dataclass(frozen=True)
class Program:
    """One rank's step: the ops it runs and, in the agreed global order, its sends and receives.

    ``ops[n]`` is (index in the rank's op list, the halves it runs); ``recvs[n][h]``
    and ``sends[n][h]`` are what half ``h`` of it receives first and sends after;
    ``sequence`` is every send and receive of this rank in the agreed order.
    """

    rank: int
    ranks: int
    forward_only: bool
    ops: tuple[tuple[int, tuple[Half, ...]], ...]
    recvs: tuple[tuple[tuple[Transfer, ...], ...], ...]
    sends: tuple[tuple[tuple[Transfer, ...], ...], ...]
    sequence: tuple[Item, ...]

    @property
    def incoming(self) -> dict[int, list[Message]]:
        """``incoming[src]``: the messages from ``src`` in the order ``src`` sends them."""
        return incoming_of(self.sequence)

    @property
    def peers(self) -> list[int]:
        """The pipeline ranks this rank exchanges messages with."""
        return peers_of(self.sequence)

    def events(self) -> list[dict[str, Any]]:
        """The program as host events: posts and waits as strict mode records them, plus one
        ``{"run": index, "op": ...}`` per executed op.

        Before an op it posts the receives the order puts before its needs and waits for
        each message the op needs; after it, it posts the op's sends (with any receives the
        order puts before them); at the end it waits for every send.
        """
        events: list[dict[str, Any]] = []
        ids: dict[tuple[str, Message], int] = {}
        position = 0

        def post_through(item: Item) -> None:
            nonlocal position
            while (self.sequence[position][0], self.sequence[position][1]) != item[:2]:
                kind, msg, peer = self.sequence[position]
                if kind == SEND:
                    raise ScheduleError(f"rank {self.rank}: {item[0]} {item[1]} is ordered after "
                                        f"send {msg}, which is not produced yet")
                _post(kind, msg, peer)
                position += 1
            _post(*item)
            position += 1

        def _post(kind: str, msg: Message, peer: int) -> None:
            ids[(kind, msg)] = len(ids)
            way = "to" if kind == SEND else "from"
            events.append({"post": kind, "group": GROUP, "peer": peer, "id": ids[(kind, msg)],
                           "what": f"{msg} {way} rank {peer}"})

        sent: list[tuple[Message, int, str]] = []
        for (index, parts), recvs, sends in zip(self.ops, self.recvs, self.sends):
            where = describe(index, parts)
            for msg, src in (t for per_half in recvs for t in per_half):
                if (RECV, msg) not in ids:
                    post_through((RECV, msg, src))
                events.append({"wait": [ids[(RECV, msg)]],
                               "what": f"receiving {msg} from rank {src}, needed by {where}"})
            events.append({"run": index, "op": op_to_json(executed_op(parts))})
            for msg, dst in (t for per_half in sends for t in per_half):
                post_through((SEND, msg, dst))
                sent.append((msg, dst, where))
        if position != len(self.sequence):
            raise ScheduleError(f"rank {self.rank}: {len(self.sequence) - position} planned messages never posted")
        events += [{"wait": [ids[(SEND, msg)]], "what": f"sending {msg} to rank {dst}, sent after {where}"}
                   for msg, dst, where in sent]
        return events


def incoming_of(sequence: tuple[Item, ...] | list[Item]) -> dict[int, list[Message]]:
    """Per source, the messages a sequence receives from it, in order."""
    incoming: dict[int, list[Message]] = {}
    for kind, msg, peer in sequence:
        if kind == RECV:
            incoming.setdefault(peer, []).append(msg)
    return incoming


def peers_of(sequence: tuple[Item, ...] | list[Item]) -> list[int]:
    """The ranks a sequence exchanges messages with, sorted."""
    return sorted({peer for _, _, peer in sequence})


def _program(rank: int, ranks: int, forward_only: bool, own: _RankOps, order: list[Routed]) -> Program:
    sequence = tuple((SEND, msg, dst) if src == rank else (RECV, msg, src)
                     for msg, src, dst in order if rank in (src, dst))
    return Program(rank, ranks, forward_only, own.ops, own.recvs, own.sends, sequence)


def lower_all(sched: Schedule, forward_only: bool = False) -> list[Program]:
    """Every rank's program (the message order computed once)."""
    per_rank = [_RankOps.of(sched, r, forward_only) for r in range(sched.ranks)]
    order = _order(sched, per_rank)
    return [_program(r, sched.ranks, forward_only, own, order) for r, own in enumerate(per_rank)]


def lower(sched: Schedule, rank: int, forward_only: bool = False) -> Program:
    """The program of pipeline rank ``rank`` for a training (or forward-only) step of ``sched``."""
    per_rank = [_RankOps.of(sched, r, forward_only) for r in range(sched.ranks)]
    return _program(rank, sched.ranks, forward_only, per_rank[rank], _order(sched, per_rank))


def programs_json(sched: Schedule, forward_only: bool = False) -> dict[str, list[dict[str, Any]]]:
    """The ``programs`` value of the schedule JSON: rank (as a string) -> events."""
    return {str(p.rank): p.events() for p in lower_all(sched, forward_only)}


def schedule_json(sched: Schedule, forward_only: bool = False) -> dict[str, Any]:
    """The schedule's JSON contract form with its lowered ``programs`` (what ``dump`` prints)."""
    return {**sched.to_json_obj(), "forward_only": forward_only, "programs": programs_json(sched, forward_only)}


def read_schedule(obj: dict[str, Any]) -> Schedule:
    """:meth:`Schedule.from_json_obj`, and if ``obj`` has ``programs``, a check that they are the
    lowering of its ops (``forward_only`` says which step; default training)."""
    sched = Schedule.from_json_obj(obj)
    if "programs" not in obj:
        return sched
    forward_only = obj.get("forward_only", False)
    if not isinstance(forward_only, bool) or not isinstance(obj["programs"], dict):
        raise ScheduleError("malformed schedule JSON: 'forward_only' must be a boolean and 'programs' "
                            "an object mapping ranks to event lists")
    given = {str(rank): events for rank, events in obj["programs"].items()}
    want = programs_json(sched, forward_only)
    if given.keys() != want.keys():
        raise ScheduleError(f"'programs' has ranks {sorted(given)}, the schedule has {sorted(want)}")
    for rank, events in want.items():
        theirs = given[rank]
        for n, (a, b) in enumerate(zip(events, theirs)):
            if a != b:
                raise ScheduleError(f"'programs' is not the lowering of 'ops': rank {rank}'s event {n} is "
                                    f"{b!r}, lowering gives {a!r}")
        if len(events) != len(theirs):
            raise ScheduleError(f"'programs' is not the lowering of 'ops': rank {rank} has {len(theirs)} "
                                f"events, lowering gives {len(events)}")
    return sched


__all__ = [
    "ACT", "GRAD", "GROUP", "Half", "Item", "Message", "Program", "RECV", "Routed", "SEND", "Transfer",
    "describe", "executed_halves", "executed_op", "incoming_of", "lower", "lower_all", "message_order",
    "needed_by", "peers_of", "programs_json", "read_schedule", "schedule_json", "sent_by",
]
