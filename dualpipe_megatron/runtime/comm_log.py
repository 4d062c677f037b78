"""The communication calls one rank's host makes in a step, in the format of :mod:`.nccl_model`.

A log is what strict mode checks and what the sweep feeds the model: the exact
posts and waits of the p2p layer (and, in strict mode, the collectives issued
during the step), not a re-derivation from the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..schedules.lower import RECV, SEND


@dataclass
class CommLog:
    """One rank's events; ``pipeline`` lists the global ranks of its pipeline group.

    ``warm`` holds the pairs ``(group, lo, hi)`` whose communicator existed
    before the step (their first message is no host rendezvous).
    """

    rank: int
    pipeline: list[int]
    warm: list[tuple[str, int, int]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    posts: int = 0

    def _next_id(self) -> int:
        self.posts += 1
        return self.posts - 1

    def post(self, kind: str, group: str, peer: int, what: str) -> int:
        """An unbatched isend (``SEND``) or irecv (``RECV``); returns its id."""
        ident = self._next_id()
        self.events.append({"post": kind, "group": group, "peer": peer, "id": ident, "what": what})
        return ident

    def collective(self, group: str, members: Sequence[int], name: str, what: str) -> int:
        ident = self._next_id()
        self.events.append(
            {"post": "coll", "group": group, "members": sorted(members), "name": name, "id": ident, "what": what}
        )
        return ident

    def wait(self, ids: Iterable[int], what: str) -> None:
        self.events.append({"wait": list(ids), "what": what})

    def to_json_obj(self) -> dict[str, Any]:
        return {"rank": self.rank, "pipeline": self.pipeline, "warm": [list(w) for w in self.warm],
                "events": self.events}


__all__ = ["CommLog", "RECV", "SEND"]
