"""The runtime's view of one rank's lowered program (:mod:`dualpipe_megatron.schedules.lower`).

The message order and the cross-rank rules are schedule data and live in
``schedules/lower.py``; this view holds them as the executor and the p2p layer
read them (lists, plus an index from each send or receive to its place in the
order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schedules.ir import Schedule
from ..schedules.lower import (
    ACT, GRAD, Half, Item, Message, Program, Transfer, executed_halves, incoming_of, lower, peers_of,
)


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
        return peers_of(self.sequence)

    @classmethod
    def of(cls, program: Program) -> "MessagePlan":
        """The view of a lowered program."""
        def nested(per_op: tuple) -> list[list[list[Transfer]]]:
            return [[list(per_half) for per_half in halves] for halves in per_op]

        return cls(program.rank, program.ranks, list(program.ops), nested(program.recvs), nested(program.sends),
                   list(program.sequence), incoming_of(program.sequence))

    @classmethod
    def build(cls, sched: Schedule, rank: int, forward_only: bool) -> "MessagePlan":
        return cls.of(lower(sched, rank, forward_only))


__all__ = ["ACT", "GRAD", "Half", "Item", "Message", "MessagePlan", "Transfer", "executed_halves"]
