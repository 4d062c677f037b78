"""A pure-Python model of NCCL p2p and collective ordering: can these host programs deadlock?

gloo buffers sends and has no per-pair queue, so a posting order that passes CPU tests can hang
on NCCL. This model replays, per rank, the exact sequence of communication calls its host made
(a lowered program's ``{"run": ...}`` events are its compute and pass) against the rules in
``docs/nccl.md``: one FIFO queue per communicator and rank (a rank pair's communicator for
unbatched ops, the process group's for batches and collectives), rendezvous sends (zero
buffering), matching by order, independent ops inside a batch except same-peer same-direction
order, blocking host waits, and the host-side rendezvous that initialises a pair's
communicator on its first use.

Only queue heads can make progress, so the fixpoint looks at a queue only when its head
changes: matching is symmetric, so whichever of two heads arrives last finds the match.
The system is monotone (ops only complete, hosts only advance), so the final state does not
depend on the order in which the fixpoint visits ranks and queues.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

Program = list[dict[str, Any]]
Comm = tuple  # (group,) for a process group's communicator, (group, lo, hi) for a pair's
QueueKey = tuple[Comm, int]  # (communicator, rank): each rank has its own stream per communicator
_OPPOSITE = {"send": "recv", "recv": "send"}


@dataclass(slots=True)
class _Part:
    """One send or recv inside a queue entry (an unbatched op is an entry with one part)."""

    kind: str
    peer: int
    done: bool = False


@dataclass(eq=False, slots=True)
class _Entry:
    """One queue entry: an unbatched op, a ``batch_isend_irecv``, or a collective (``name`` set)."""

    rank: int
    id: int
    what: str
    comm: Comm
    parts: list[_Part]
    batched: bool
    name: str = ""
    members: tuple[int, ...] = ()
    done: bool = False

    def describe(self) -> str:
        """Human text for reports: kind, id, peers and the caller's ``what``."""
        what = f" ({self.what})" if self.what else ""
        if self.name:
            return f"{self.name} #{self.id} on {self.comm[0]}{what}"
        if not self.batched:
            part = self.parts[0]
            return f"{part.kind} #{self.id} {'to' if part.kind == 'send' else 'from'} rank {part.peer}{what}"
        ops = ", ".join(f"{p.kind} {'to' if p.kind == 'send' else 'from'} {p.peer}{' (done)' if p.done else ''}"
                        for p in self.parts)
        return f"batch #{self.id} [{ops}]{what}"


def _comm_name(comm: Comm) -> str:
    return f"({comm[0]}, {comm[1]}<->{comm[2]})" if len(comm) == 3 else f"({comm[0]})"


def _queue_name(key: QueueKey) -> str:
    return f"{_comm_name(key[0])} on rank {key[1]}"


@dataclass
class Verdict:
    """Outcome of :func:`check`; ``ok`` only when every program finished and every posted op completed."""

    ok: bool
    ranks: int
    events: int
    blocked: dict[int, str] = field(default_factory=dict)
    heads: dict[str, str] = field(default_factory=dict)
    cycle: list[int] = field(default_factory=list)
    mismatch: list[str] = field(default_factory=list)
    leftover: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """One line: the verdict and its headline reason."""
        if self.ok:
            return f"deadlock-free: {self.ranks} ranks, {self.events} events"
        if self.blocked or self.mismatch:
            why = [f"{len(self.blocked)} of {self.ranks} ranks blocked"]
            if self.cycle:
                why.append("cycle " + " -> ".join(map(str, self.cycle)))
            if self.mismatch:
                why.append(f"{len(self.mismatch)} collective mismatch(es)")
            return "DEADLOCK: " + ", ".join(why)
        return (f"NOT OK: all {self.ranks} programs finished but {len(self.leftover)} posted op(s) "
                "never completed and were never waited for")

    def report(self) -> str:
        """Multi-line text: the summary, blocked ranks, queue heads, cycle, mismatches, leftovers."""
        lines = [self.summary]
        for title, rows in (("blocked ranks", [f"rank {r}: {t}" for r, t in sorted(self.blocked.items())]),
                            ("queue heads", [f"{q}: {d}" for q, d in self.heads.items()]),
                            ("collective mismatches", self.mismatch),
                            ("never completed", self.leftover)):
            if rows:
                lines += [f"{title}:"] + [f"  {row}" for row in rows]
        if self.cycle:
            lines.append("wait-for cycle: " + " -> ".join(f"rank {r}" for r in self.cycle))
        return "\n".join(lines)


def _entry(rank: int, event: dict[str, Any], ranks: dict[int, Program], pair_mode: bool, where: str) -> _Entry:
    """The queue entry one post makes (validated); ``where`` names the event in errors."""
    kind, op_id, group, what = event["post"], event["id"], event["group"], event.get("what", "")

    def peer_of(value: Any) -> int:
        if value not in ranks or value == rank:
            raise ValueError(f"{where}: peer {value!r} is not another rank of the programs")
        return value

    if kind == "coll":
        members = tuple(event["members"])
        if rank not in members or any(m not in ranks for m in members):
            raise ValueError(f"{where}: members {list(members)} must include this rank and only ranks of the programs")
        return _Entry(rank, op_id, what, (group,), [], True, str(event["name"]), members)
    if kind == "batch":
        parts = [_Part(op["kind"], peer_of(op["peer"])) for op in event["ops"]]
        if not parts or any(p.kind not in _OPPOSITE for p in parts):
            raise ValueError(f"{where}: a batch needs one or more ops of kind send/recv")
        return _Entry(rank, op_id, what, (group,), parts, True)
    peer = peer_of(event["peer"])
    comm = (group, min(rank, peer), max(rank, peer)) if pair_mode else (group,)
    return _Entry(rank, op_id, what, comm, [_Part(kind, peer)], False)


def _build(programs: dict[int, Program], pair_mode: bool) -> dict[int, dict[int, _Entry]]:
    """Validate the programs and make one queue entry per post, keyed by rank and id."""
    entries: dict[int, dict[int, _Entry]] = {}
    for rank, program in programs.items():
        if not isinstance(rank, int):
            raise ValueError(f"rank keys must be ints, got {rank!r}")
        mine = entries[rank] = {}
        for index, event in enumerate(program):
            where = f"rank {rank} event {index}"
            try:
                if isinstance(event, dict) and "wait" in event and "post" not in event:
                    if any(i not in mine for i in event["wait"]):
                        unknown = [i for i in event["wait"] if i not in mine]
                        raise ValueError(f"{where}: waits on id(s) {unknown} this rank has not posted before")
                elif isinstance(event, dict) and event.get("post") in ("send", "recv", "batch", "coll"):
                    if event["id"] in mine:
                        raise ValueError(f"{where}: duplicate id {event['id']}")
                    mine[event["id"]] = _entry(rank, event, programs, pair_mode, where)
                elif not (isinstance(event, dict) and "run" in event and "post" not in event):
                    raise ValueError(f"{where}: unknown event {event!r}; expected a 'post' of "
                                     "send/recv/batch/coll, a 'wait' or a 'run'")
            except KeyError as missing:
                raise ValueError(f"{where}: missing field {missing} in {event!r}") from None
    return entries


class _Model:
    """The fixpoint: hosts advance through their events, queue heads complete, until nothing changes."""

    def __init__(self, programs: dict[int, Program], unbatched: str, warm: Iterable[tuple[str, int, int]]):
        if unbatched not in ("pair", "group"):
            raise ValueError(f"unbatched must be 'pair' or 'group', got {unbatched!r}")
        self.programs = programs
        self.entries = _build(programs, unbatched == "pair")
        self.ready = {(g, min(a, b), max(a, b)) for g, a, b in warm}  # pairs whose communicator exists
        self.arrived: dict[Comm, set[int]] = {}  # ranks waiting at their first post on an unready pair
        self.pc = dict.fromkeys(programs, 0)  # next event per rank
        self.wait_pos = dict.fromkeys(programs, 0)  # ids of the current wait known complete so far
        self.queues: dict[QueueKey, deque[_Entry]] = {}
        self.hosts: deque[int] = deque(programs)
        self.dirty: deque[QueueKey] = deque()

    def run(self) -> None:
        """Alternate host advances and head checks until neither has anything left to look at."""
        while self.hosts or self.dirty:
            while self.hosts:
                self._advance(self.hosts.popleft())
            while self.dirty:
                queue = self.queues[self.dirty.popleft()]
                if queue:
                    self._progress(queue[0])

    def _advance(self, rank: int) -> None:
        """Run a host until it blocks at a wait or at the first-use rendezvous of a pair."""
        program, mine = self.programs[rank], self.entries[rank]
        while self.pc[rank] < len(program):
            event = program[self.pc[rank]]
            if "run" in event:
                pass  # compute: no communication, never blocks the host
            elif "wait" in event:
                ids, pos = event["wait"], self.wait_pos[rank]
                while pos < len(ids) and mine[ids[pos]].done:
                    pos += 1
                self.wait_pos[rank] = 0 if pos == len(ids) else pos
                if pos < len(ids):
                    return
            else:
                entry = mine[event["id"]]
                if len(entry.comm) == 3 and entry.comm not in self.ready:
                    waiting = self.arrived.setdefault(entry.comm, set())
                    waiting.add(rank)
                    if len(waiting) < 2:
                        return
                    self.ready.add(entry.comm)
                    self.hosts.append(entry.parts[0].peer)
                key = (entry.comm, rank)
                queue = self.queues.setdefault(key, deque())
                queue.append(entry)
                if len(queue) == 1:
                    self.dirty.append(key)
            self.pc[rank] += 1

    def _head(self, comm: Comm, rank: int) -> _Entry | None:
        queue = self.queues.get((comm, rank))
        return queue[0] if queue else None

    def _mate(self, comm: Comm, owner: int, kind: str, peer: int) -> _Part | None:
        """The first pending ``kind`` op with ``peer`` in the head entry of ``owner``'s queue, if any."""
        head = self._head(comm, owner)
        if head is None or head.name:
            return None
        return next((p for p in head.parts if not p.done and p.kind == kind and p.peer == peer), None)

    def _progress(self, head: _Entry) -> None:
        """Complete what the head entry can: its collective, or its parts whose mates head the peers' queues."""
        if head.name:
            heads = [self._head(head.comm, m) for m in head.members]
            if all(h is not None and (h.name, h.members) == (head.name, head.members) for h in heads):
                for h in heads:
                    self._complete(h)
            return
        blocked: set[tuple[str, int]] = set()  # same peer and direction keep their order in a batch
        for part in head.parts:
            if part.done or (part.kind, part.peer) in blocked:
                continue
            mate = self._mate(head.comm, part.peer, _OPPOSITE[part.kind], head.rank)
            if mate is None:
                blocked.add((part.kind, part.peer))
                continue
            part.done = mate.done = True
            other = self._head(head.comm, part.peer)
            if all(p.done for p in other.parts):
                self._complete(other)
        if all(p.done for p in head.parts):
            self._complete(head)

    def _complete(self, entry: _Entry) -> None:
        """Pop a finished head: the entry behind it is a new head, and its host may pass a wait."""
        entry.done = True
        key = (entry.comm, entry.rank)
        queue = self.queues[key]
        queue.popleft()
        if queue:
            self.dirty.append(key)
        self.hosts.append(entry.rank)

    def _why(self, entry: _Entry) -> tuple[str, set[int]]:
        """Why an incomplete op waits, and the ranks whose progress it needs (wait-for edges)."""
        key = (entry.comm, entry.rank)
        head = self.queues[key][0]
        reasons, needs = [], set()
        if head.name:
            for m in head.members:
                other = self._head(head.comm, m)
                if other is None or (other.name, other.members) != (head.name, head.members):
                    needs.add(m)
                    reasons.append(f"rank {m} has not posted it" if other is None
                                   else f"rank {m}'s head is {other.describe()}")
        else:
            seen = set()
            for p in head.parts:
                if p.done or (p.kind, p.peer) in seen:
                    continue
                seen.add((p.kind, p.peer))
                needs.add(p.peer)
                other = self._head(head.comm, p.peer)
                reasons.append(f"its {p.kind} needs rank {p.peer}, " + (
                    "which has not posted the matching op" if other is None
                    else f"whose head of {_queue_name((head.comm, p.peer))} is {other.describe()}"))
        where = "at the head of" if head is entry else f"behind {head.describe()} at the head of"
        return f"{where} queue {_queue_name(key)}: " + "; ".join(reasons), needs

    def verdict(self) -> Verdict:
        blocked, edges = {}, {}
        for rank, program in self.programs.items():
            if self.pc[rank] == len(program):
                continue
            event = program[self.pc[rank]]
            if "wait" in event:
                pending = [self.entries[rank][i] for i in event["wait"] if not self.entries[rank][i].done]
                text, needs = self._why(pending[0])
                for entry in pending[1:]:
                    needs |= self._why(entry)[1]
                more = f" and {len(pending) - 1} more" if len(pending) > 1 else ""
                label = f" in wait ({event['what']})" if event.get("what") else ""
                blocked[rank] = f"waits for {pending[0].describe()}{more}{label}: {text}"
            else:
                entry = self.entries[rank][event["id"]]
                peer = entry.parts[0].peer
                needs = {peer}
                blocked[rank] = (f"posts {entry.describe()}, the first use of pair {_comm_name(entry.comm)}"
                                 f"; rendezvous waits for rank {peer} to reach its first post on that pair")
            edges[rank] = sorted(needs)
        heads = {_queue_name(k): q[0].describe() + (f" (+{len(q) - 1} queued behind)" if len(q) > 1 else "")
                 for k, q in sorted(self.queues.items(), key=lambda kq: (kq[0][1], kq[0][0])) if q}
        mismatch = sorted({f"{h.comm[0]}: rank {h.rank} at {h.describe()} vs rank {m} at {o.describe()}"
                           for h in (q[0] for q in self.queues.values() if q and q[0].name)
                           for m in h.members
                           if (o := self._head(h.comm, m)) is not None and o.name and h.rank < m
                           and (o.name, o.members) != (h.name, h.members)})
        leftover = [f"rank {r}: {e.describe()}" for r, mine in self.entries.items()
                    if r not in blocked for e in mine.values() if not e.done]
        ok = not (blocked or mismatch or leftover)
        return Verdict(ok, len(self.programs), sum(map(len, self.programs.values())), blocked,
                       heads, _find_cycle(edges), mismatch, leftover)


def _find_cycle(edges: dict[int, list[int]]) -> list[int]:
    """A cycle in the wait-for graph (first rank repeated at the end), or [] if there is none."""
    state: dict[int, int] = {}  # 1: on the DFS stack, 2: explored
    stack: list[int] = []

    def visit(rank: int) -> list[int]:
        state[rank] = 1
        stack.append(rank)
        for nxt in edges.get(rank, ()):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[rank] = 2
        return []

    for rank in sorted(edges):
        if rank not in state and (cycle := visit(rank)):
            return cycle
    return []


def check(programs: dict[int, Program], *, unbatched: str = "pair",
          warm: Iterable[tuple[str, int, int]] = ()) -> Verdict:
    """Decide whether the per-rank communication programs run to completion on NCCL.

    ``unbatched="pair"`` is torch's default (one communicator per rank pair for unbatched
    ops); ``"group"`` models ``device_id`` at init (unbatched ops on the group's communicator,
    which exists from init, so there is no first-use rendezvous). ``warm`` lists pairs
    ``(group, a, b)`` whose communicator already exists (only meaningful for ``"pair"``).
    """
    model = _Model(programs, unbatched, warm)
    model.run()
    return model.verdict()


def load_programs(source: str | Path | dict) -> dict[int, Program]:
    """Programs from a JSON file or object: ``{"programs": {rank: [...]}}`` or ``{rank: [...]}``."""
    data = json.loads(Path(source).read_text()) if isinstance(source, (str, Path)) else source
    if isinstance(data, dict) and "programs" in data:
        data = data["programs"]
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object mapping ranks to event lists")
    return {int(rank): events for rank, events in data.items()}
