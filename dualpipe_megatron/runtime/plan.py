"""Message plans: which transfers a rank makes, and one posting order every rank agrees on.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schedules.ir import B, F, Key, Op, Schedule, W, halves
from .comm_log import RECV, SEND

ACT = "activation"
GRAD = "gradient"

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


def executed_halves(op: Op, forward_only: bool) -> tuple[Half, ...]:
    """The single ops a rank actually runs for ``op`` (forward-only keeps the F's)."""
    parts = halves(op)
    return tuple(h for h in parts if isinstance(h, F)) if forward_only else parts


def sent_by(sched: Schedule, rank: int, half: Half) -> list[Transfer]:
    """Cross-rank messages ``half`` produces on ``rank``, as (message, destination)."""
    k = half.key
    if isinstance(half, F) and k.s + 1 < sched.stages:
        dst = sched.rank_of(k.d, k.s + 1)
        return [(Message(ACT, k), dst)] if dst != rank else []
    if isinstance(half, B) and k.s > 0:
        dst = sched.rank_of(k.d, k.s - 1)
        return [(Message(GRAD, k), dst)] if dst != rank else []
    return []


def needed_by(sched: Schedule, rank: int, half: Half) -> list[Transfer]:
    """Cross-rank messages ``half`` waits for on ``rank``, as (message, source)."""
    k = half.key
    if isinstance(half, F) and k.s > 0:
        src = sched.rank_of(k.d, k.s - 1)
        return [(Message(ACT, Key(k.d, k.s - 1, k.m)), src)] if src != rank else []
    if isinstance(half, B) and k.s + 1 < sched.stages:
        src = sched.rank_of(k.d, k.s + 1)
        return [(Message(GRAD, Key(k.d, k.s + 1, k.m)), src)] if src != rank else []
    return []


@dataclass
class _RankOps:
    """One rank's executed ops with what each half receives first and sends after."""

    ops: list[tuple[int, tuple[Half, ...]]]
    recvs: list[list[list[Transfer]]]
    sends: list[list[list[Transfer]]]

    @classmethod
    def of(cls, sched: Schedule, rank: int, forward_only: bool) -> "_RankOps":
        ops = [(i, executed_halves(op, forward_only)) for i, op in enumerate(sched.ops[rank])]
        ops = [(i, parts) for i, parts in ops if parts]
        return cls(
            ops,
            [[needed_by(sched, rank, h) for h in parts] for _, parts in ops],
            [[sent_by(sched, rank, h) for h in parts] for _, parts in ops],
        )


def message_order(sched: Schedule, forward_only: bool) -> list[tuple[Message, int, int]]:
    """Every cross-rank message as (message, source, destination), in the agreed posting order."""
    per_rank = [_RankOps.of(sched, r, forward_only) for r in range(sched.ranks)]
    sent_at: dict[Message, int] = {}
    keyed: list[tuple[tuple[int, int, int], Message, int, int]] = []
    cursor = [0] * sched.ranks
    free = [0] * sched.ranks
    progressed = True
    while progressed:
        progressed = False
        for r, plan in enumerate(per_rank):
            while cursor[r] < len(plan.ops):
                n = cursor[r]
                needs = [msg for per_half in plan.recvs[n] for msg, _ in per_half]
                if any(msg not in sent_at for msg in needs):
                    break
                start = max([free[r], *(sent_at[msg] for msg in needs)])
                free[r] = end = start + len(plan.ops[n][1])
                for msg, dst in (t for per_half in plan.sends[n] for t in per_half):
                    sent_at[msg] = end
                    keyed.append(((end, r, len(keyed)), msg, r, dst))
                cursor[r] += 1
                progressed = True
    stuck = {r: str(per_rank[r].ops[c][1]) for r, c in enumerate(cursor) if c < len(per_rank[r].ops)}
    if stuck:
        raise ValueError(f"schedule {sched.name!r} cannot run: ops waiting for messages never sent: {stuck}")
    return [(msg, src, dst) for _, msg, src, dst in sorted(keyed, key=lambda item: item[0])]


@dataclass
class MessagePlan:
    """What one rank receives before, and sends after, each half of each of its ops.

    ``sequence`` is every send and receive of this rank in the agreed posting
    order; ``incoming[src]`` the messages from ``src`` in the order ``src``
    sends them.
    """

    rank: int
    ranks: int
    ops: list[tuple[int, tuple[Half, ...]]]  # (index in the rank's op list, halves run)
    recvs: list[list[list[Transfer]]]
    sends: list[list[list[Transfer]]]
    sequence: list[Item] = field(default_factory=list)
    incoming: dict[int, list[Message]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {(kind, msg): i for i, (kind, msg, _) in enumerate(self.sequence)}

    @property
    def peers(self) -> list[int]:
        """The pipeline ranks this rank exchanges messages with."""
        return sorted({peer for _, _, peer in self.sequence})

    @classmethod
    def build(cls, sched: Schedule, rank: int, forward_only: bool) -> "MessagePlan":
        own = _RankOps.of(sched, rank, forward_only)
        sequence: list[Item] = []
        incoming: dict[int, list[Message]] = {}
        for msg, src, dst in message_order(sched, forward_only):
            if src == rank:
                sequence.append((SEND, msg, dst))
            elif dst == rank:
                sequence.append((RECV, msg, src))
                incoming.setdefault(src, []).append(msg)
        return cls(rank, sched.ranks, own.ops, own.recvs, own.sends, sequence, incoming)


__all__ = [
    "ACT", "GRAD", "Item", "Message", "MessagePlan", "Transfer", "executed_halves",
    "message_order", "needed_by", "sent_by",
]
