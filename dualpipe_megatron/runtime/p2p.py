"""Point-to-point transfers, planned from the schedule IR.

Batched and unbatched p2p both match a sender's and a receiver's operations by
posting order per (sender, receiver) pair, and tags do not help on NCCL. So
both sides derive one order from the IR: a rank posts its sends to a peer in
the order its op list produces them, and the peer posts the matching receives
in that same sender order, lazily, up to the message its next op needs.

Sends never block an op; they are reaped when complete (freeing sent
activations) and waited for at the end of the step. Receives are waited for
just before the op that needs them, and the time spent in those waits is
summed (``waited_ns``) so a tracer can tell waiting from computing. With a
valid (deadlock-free) IR every awaited message is eventually sent, so the
protocol cannot deadlock; every wait still has a timeout, so a failed peer
turns into an error, not a hang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from time import perf_counter_ns
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..schedules.ir import B, F, Key, Op, Schedule, W, halves

ACT = "activation"
GRAD = "gradient"
_KIND_CODE = {ACT: 0, GRAD: 1}

Half = F | B | W
Shape = tuple[int, ...]


class PipelineCommError(RuntimeError):
    """A p2p wait that timed out or failed; names this rank, the peer, the op and the micro-batch."""


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


def executed_halves(op: Op, forward_only: bool) -> tuple[Half, ...]:
    """The single ops a rank actually runs for ``op`` (forward-only keeps the F's)."""
    parts = halves(op)
    return tuple(h for h in parts if isinstance(h, F)) if forward_only else parts


def _sent_by(sched: Schedule, rank: int, half: Half) -> list[tuple[Message, int]]:
    """Cross-rank messages ``half`` produces on ``rank``, as (message, destination)."""
    k = half.key
    if isinstance(half, F) and k.s + 1 < sched.stages:
        dst = sched.rank_of(k.d, k.s + 1)
        return [(Message(ACT, k), dst)] if dst != rank else []
    if isinstance(half, B) and k.s > 0:
        dst = sched.rank_of(k.d, k.s - 1)
        return [(Message(GRAD, k), dst)] if dst != rank else []
    return []


def _needed_by(sched: Schedule, rank: int, half: Half) -> list[tuple[Message, int]]:
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
class MessagePlan:
    """What one rank receives before, and sends after, each half of each of its ops."""

    rank: int
    ops: list[tuple[int, tuple[Half, ...]]]  # (index in the rank's op list, halves run)
    recvs: list[list[list[tuple[Message, int]]]]
    sends: list[list[list[tuple[Message, int]]]]
    incoming: dict[int, list[Message]] = field(default_factory=dict)  # per source, in its send order

    def __post_init__(self) -> None:
        self.position = {src: {msg: i for i, msg in enumerate(msgs)} for src, msgs in self.incoming.items()}

    @classmethod
    def build(cls, sched: Schedule, rank: int, forward_only: bool) -> "MessagePlan":
        ops = [(i, executed_halves(op, forward_only)) for i, op in enumerate(sched.ops[rank])]
        ops = [(i, parts) for i, parts in ops if parts]
        recvs = [[_needed_by(sched, rank, h) for h in parts] for _, parts in ops]
        sends = [[_sent_by(sched, rank, h) for h in parts] for _, parts in ops]
        incoming: dict[int, list[Message]] = {}
        for src, src_ops in enumerate(sched.ops):
            if src == rank:
                continue
            for op in src_ops:
                for half in executed_halves(op, forward_only):
                    for msg, dst in _sent_by(sched, src, half):
                        if dst == rank:
                            incoming.setdefault(src, []).append(msg)
        return cls(rank, ops, recvs, sends, incoming)


@dataclass
class _Recv:
    works: list[dist.Work]
    buffers: list[torch.Tensor]
    header: torch.Tensor | None


@dataclass
class _Send:
    works: list[dist.Work]
    msg: Message
    dst: int
    after: str
    payload: list[torch.Tensor]  # held until the send completes (it may be a contiguous copy)
    to_free: list[torch.Tensor]


class P2P:
    """Posts and waits for one step's transfers of one rank, following a :class:`MessagePlan`.

    ``group_rank_of[r]`` is pipeline rank ``r``'s rank in ``group``. With
    ``debug`` every message is preceded by a header carrying its
    (kind, d, s, m), checked on arrival.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        group_rank_of: Sequence[int],
        device: torch.device,
        shapes: Callable[[tuple[int, int]], list[Shape]],
        dtype: torch.dtype,
        timeout: float,
        debug: bool = False,
    ) -> None:
        self.group = group
        self.rank = rank
        self.group_rank_of = list(group_rank_of)
        self.device = device
        self.shapes = shapes
        self.dtype = dtype
        self.timeout = timeout
        self.debug = debug
        self._plan: MessagePlan | None = None

    # -- step lifecycle ----------------------------------------------------
    def begin(self, plan: MessagePlan) -> None:
        self._plan = plan
        self._posted = {src: 0 for src in plan.incoming}
        self._recvs: dict[Message, _Recv] = {}
        self._sends: list[_Send] = []
        self.freed = 0
        self.waited_ns = 0  # this step's time blocked in receives (two clock reads per message)

    def finish(self) -> None:
        """Wait for every send; check that every planned receive was posted and used."""
        for send in self._sends:
            self._wait_all(send.works, f"sending {send.msg} to rank {send.dst}, sent after {send.after}", send.dst)
            self._free(send.to_free)
        self._sends = []
        assert self._plan is not None
        unposted = {src: len(msgs) - self._posted[src] for src, msgs in self._plan.incoming.items()}
        if any(unposted.values()) or self._recvs:
            raise RuntimeError(
                f"pipeline rank {self.rank}: step ended with planned receives unused "
                f"(unposted per source {unposted}, posted but unread {sorted(map(str, self._recvs))})"
            )

    # -- receiving -----------------------------------------------------------
    def prefetch(self, needs: Sequence[tuple[Message, int]]) -> None:
        """Post (in sender order) every receive up to the ones listed."""
        for msg, src in needs:
            self._post_up_to(msg, src)

    def recv(self, msg: Message, src: int, needed_by: str) -> list[torch.Tensor]:
        """The tensors of ``msg`` from ``src``, once arrived (``needed_by`` names the op for errors)."""
        self._post_up_to(msg, src)
        pending = self._recvs.pop(msg)
        what = f"receiving {msg} from rank {src}, needed by {needed_by}"
        began = perf_counter_ns()
        if pending.header is not None:
            self._wait_all(pending.works[:1], what, src)
            self._check_header(pending.header, msg, src, len(pending.buffers), needed_by)
            self._wait_all(pending.works[1:], what, src)
        else:
            self._wait_all(pending.works, what, src)
        self.waited_ns += perf_counter_ns() - began
        return pending.buffers

    def _post_up_to(self, msg: Message, src: int) -> None:
        try:
            target = self._plan.position[src][msg]
        except KeyError:
            raise RuntimeError(
                f"pipeline rank {self.rank}: {msg} from rank {src} is not in the message plan"
            ) from None
        incoming = self._plan.incoming[src]
        while self._posted[src] <= target:
            self._post_recv(incoming[self._posted[src]], src)
            self._posted[src] += 1

    def _post_recv(self, msg: Message, src: int) -> None:
        peer = self.group_rank_of[src]
        works: list[dist.Work] = []
        header = None
        if self.debug:
            header = torch.empty(5, dtype=torch.int64, device=self.device)
            works.append(dist.irecv(header, group=self.group, group_src=peer))
        buffers = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in self.shapes(msg.edge)]
        works += [dist.irecv(t, group=self.group, group_src=peer) for t in buffers]
        self._recvs[msg] = _Recv(works, buffers, header)

    def _check_header(self, header: torch.Tensor, msg: Message, src: int, count: int, needed_by: str) -> None:
        got = [int(v) for v in header.tolist()]
        want = [_KIND_CODE[msg.kind], msg.key.d, msg.key.s, msg.key.m, count]
        if got != want:
            kinds = {v: k for k, v in _KIND_CODE.items()}
            described = (
                f"{kinds.get(got[0], got[0])} of (d={got[1]},s={got[2]},m={got[3]}) with {got[4]} tensor(s)"
            )
            raise PipelineCommError(
                f"pipeline rank {self.rank}: message mismatch from rank {src} for {needed_by}: "
                f"expected {msg} with {count} tensor(s), got {described}"
            )

    # -- sending -------------------------------------------------------------
    def send(
        self, msg: Message, dst: int, tensors: Sequence[torch.Tensor], after: str,
        free: Sequence[torch.Tensor] = (),
    ) -> None:
        """Post ``tensors`` as ``msg``; the tensors in ``free`` lose their storage once sent."""
        shapes = self.shapes(msg.edge)
        if len(tensors) != len(shapes):
            raise ValueError(
                f"pipeline rank {self.rank}: {msg} has {len(tensors)} tensor(s), but "
                f"{len(shapes)} are declared for the outputs of stage (d={msg.edge[0]},s={msg.edge[1]})"
            )
        for i, (t, shape) in enumerate(zip(tensors, shapes)):
            if tuple(t.shape) != tuple(shape) or t.dtype != self.dtype:
                raise ValueError(
                    f"pipeline rank {self.rank}: tensor {i} of {msg} is {tuple(t.shape)} {t.dtype}, "
                    f"but the declared p2p shape is {tuple(shape)} {self.dtype}"
                )
        peer = self.group_rank_of[dst]
        payload = [t.contiguous() for t in tensors]
        works: list[dist.Work] = []
        if self.debug:
            k = msg.key
            header = torch.tensor(
                [_KIND_CODE[msg.kind], k.d, k.s, k.m, len(payload)], dtype=torch.int64, device=self.device
            )
            payload = [header] + payload
        works += [dist.isend(t, group=self.group, group_dst=peer) for t in payload]
        # Free only tensors that went out as they are (a contiguous copy was sent otherwise).
        to_free = [t for t in free if any(t is p for p in payload)]
        self._sends.append(_Send(works, msg, dst, after, payload, to_free))

    def reap(self) -> None:
        """Without blocking, retire completed sends and free what they carried."""
        still = []
        for send in self._sends:
            if all(w.is_completed() for w in send.works):
                self._free(send.to_free)
            else:
                still.append(send)
        self._sends = still

    def _free(self, tensors: Sequence[torch.Tensor]) -> None:
        """Drop the storage of sent activations; their grad_fn keeps the graph alive for backward."""
        for t in tensors:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.freed += len(tensors)

    # -- waiting -------------------------------------------------------------
    def _wait_all(self, works: Sequence[dist.Work], what: str, peer: int) -> None:
        for work in works:
            wait(work, self.timeout, lambda: f"pipeline rank {self.rank}: {what} (peer rank {peer})")


def wait(work: dist.Work, timeout: float, describe: Callable[[], str]) -> None:
    """``work.wait`` bounded by ``timeout`` seconds; failures become :class:`PipelineCommError`."""
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        reason = "timed out" if "imed out" in str(exc) else "failed"
        raise PipelineCommError(f"{describe()}: {reason} (timeout {timeout:g}s): {exc}") from exc


__all__ = ["ACT", "GRAD", "Message", "MessagePlan", "P2P", "PipelineCommError", "executed_halves", "wait"]
